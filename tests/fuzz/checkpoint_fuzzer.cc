// Fuzz target: the checkpoint reader, on the bytes of a file (the framing is fuzzed too; the
// CRC makes random bodies rare, so the target also frames the input itself half of the time).
#include <zlib.h>

#include <cstdint>
#include <string>

#include "server/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string bytes(reinterpret_cast<const char*>(data), size);
  (void)dbs::DecodeCheckpoint(bytes);
  // The same bytes as the body of a well-framed checkpoint.
  std::string framed = "DBSCKPT2";
  for (int i = 0; i < 8; ++i) framed.push_back(static_cast<char>(uint64_t{size} >> (8 * i)));
  framed += bytes;
  const uint32_t crc = static_cast<uint32_t>(
      crc32(0L, reinterpret_cast<const Bytef*>(framed.data()), static_cast<uInt>(framed.size())));
  for (int i = 0; i < 4; ++i) framed.push_back(static_cast<char>(crc >> (8 * i)));
  (void)dbs::DecodeCheckpoint(framed);
  return 0;
}
