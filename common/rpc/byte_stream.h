// ByteStream: a client's bidirectional stream of raw bytes on one gRPC method, through gRPC's
// public generic stub. Each operation runs to completion on the calling thread, on a completion
// queue of the stream's own: no hand-over from one of gRPC's threads (two more wake-ups per
// message, which a worker held to a CPU quota pays in throttled time). One operation at a time;
// ClientContext::TryCancel, from any thread, ends the one in progress.
#ifndef DBS_COMMON_RPC_BYTE_STREAM_H_
#define DBS_COMMON_RPC_BYTE_STREAM_H_

#include <memory>
#include <string>

#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/completion_queue.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/status.h"

namespace dbs {

class ByteStream {
 public:
  // Starts a call of `method` ("/package.Service/Method") on `channel`. `ctx` (its metadata and
  // deadline set) must outlive the stream.
  ByteStream(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
             grpc::ClientContext* ctx);
  // Cancels the call unless it was finished.
  ~ByteStream();
  ByteStream(const ByteStream&) = delete;
  ByteStream& operator=(const ByteStream&) = delete;

  // False once the stream has failed or ended: Finish says why.
  bool Write(const grpc::ByteBuffer& message);
  bool Read(grpc::ByteBuffer* message);
  // How the call ended (after a failed Write or Read, or to end it); once.
  grpc::Status Finish();

 private:
  // Waits for the operation in progress; whether it succeeded.
  bool Await();

  grpc::ClientContext* const ctx_;
  grpc::CompletionQueue queue_;
  grpc::GenericStub stub_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
  bool ok_ = false;  // started, and no operation has failed
  bool finished_ = false;
};

}  // namespace dbs

#endif  // DBS_COMMON_RPC_BYTE_STREAM_H_
