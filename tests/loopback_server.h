// A gRPC service alone on a loopback port picked at run time, for tests of one adapter or client.
#ifndef DBS_TESTS_LOOPBACK_SERVER_H_
#define DBS_TESTS_LOOPBACK_SERVER_H_

#include <memory>
#include <string>

#include "grpcpp/grpcpp.h"

namespace dbs {

struct LoopbackServer {
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::string address() const { return "127.0.0.1:" + std::to_string(port); }
};

inline LoopbackServer ServeOnLoopback(grpc::Service* service) {
  grpc::ServerBuilder builder;
  LoopbackServer s;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &s.port);
  builder.RegisterService(service);
  s.server = builder.BuildAndStart();
  return s;
}

}  // namespace dbs

#endif  // DBS_TESTS_LOOPBACK_SERVER_H_
