#include "common/rpc/byte_stream.h"

namespace dbs {

ByteStream::ByteStream(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                       grpc::ClientContext* ctx)
    : ctx_(ctx), stub_(channel) {
  call_ = stub_.PrepareCall(ctx, method, &queue_);
  if (call_ == nullptr) return;
  call_->StartCall(this);
  ok_ = Await();
}

ByteStream::~ByteStream() {
  if (call_ != nullptr && !finished_) {
    ctx_->TryCancel();
    Finish();
  }
  queue_.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (queue_.Next(&tag, &ok)) {
  }
}

bool ByteStream::Await() {
  void* tag = nullptr;
  bool ok = false;
  return queue_.Next(&tag, &ok) && ok;  // one operation at a time: the tag is ours
}

bool ByteStream::Write(const grpc::ByteBuffer& message) {
  if (!ok_) return false;
  call_->Write(message, this);
  ok_ = Await();
  return ok_;
}

bool ByteStream::Read(grpc::ByteBuffer* message) {
  if (!ok_) return false;
  call_->Read(message, this);
  ok_ = Await();
  return ok_;
}

grpc::Status ByteStream::Finish() {
  if (call_ == nullptr) return grpc::Status(grpc::StatusCode::INTERNAL, "the call was not created");
  if (finished_) return grpc::Status(grpc::StatusCode::INTERNAL, "the stream was finished before");
  finished_ = true;
  ok_ = false;
  grpc::Status status;
  call_->Finish(&status, this);
  Await();
  return status;
}

}  // namespace dbs
