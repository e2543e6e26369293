// dbs_health_probe: asks a dbs_ps's grpc.health.v1 service whether it is serving; for health
// checks that run a command (docker-compose's healthcheck). Exit code 0 when SERVING, 1 when
// not serving or unreachable, 2 for bad flags.
#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/time/clock.h"
#include "common/cli.h"
#include "grpcpp/grpcpp.h"
#include "proto/health.grpc.pb.h"

ABSL_FLAG(std::string, server, "127.0.0.1:50051", "Address of dbs_ps (host:port).");
ABSL_FLAG(double, timeout_s, 5.0, "How long to wait for the answer.");

int main(int argc, char** argv) {
  // It runs in dbs_ps's container, whose DBS_* variables are dbs_ps's.
  dbs::ParseCommandLine(argc, argv,
                        "dbs_health_probe: exits 0 when dbs_ps's health service says SERVING.\n"
                        "Example: dbs_health_probe --server=dbs-ps:50051",
                        "health_probe_main.cc", {}, dbs::FlagSources::kCommandLineOnly);
  const std::string server = absl::GetFlag(FLAGS_server);
  const double timeout_s = absl::GetFlag(FLAGS_timeout_s);
  if (!(timeout_s > 0)) {
    std::cerr << "dbs_health_probe: --timeout_s must be > 0" << std::endl;
    return dbs::kExitBadConfig;
  }
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(server, grpc::InsecureChannelCredentials()));
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse reply;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(timeout_s)));
  const grpc::Status s = stub->Check(&ctx, req, &reply);
  if (!s.ok()) {
    std::cout << server << ": unreachable (" << s.error_message() << ")" << std::endl;
    return dbs::kExitFailed;
  }
  std::cout << server << ": "
            << grpc::health::v1::HealthCheckResponse::ServingStatus_Name(reply.status())
            << std::endl;
  return reply.status() == grpc::health::v1::HealthCheckResponse::SERVING ? dbs::kExitOk
                                                                          : dbs::kExitFailed;
}
