// StatusHttpServer: dbs_ps's HTTP endpoint (cpp-httplib) for people and monitors:
//   /metrics      Prometheus text format (server/metrics.h);
//   /status.json  the live state: the run summary plus epoch, step and ETA;
//   /             a self-refreshing status page (per-worker shares and compute/wait, the
//                 imbalance per epoch, loss and accuracy), with no external asset.
// It only reads the job. Serves on its own threads until destroyed.
#ifndef DBS_SERVER_STATUS_HTTP_H_
#define DBS_SERVER_STATUS_HTTP_H_

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "common/clock.h"
#include "server/metrics.h"
#include "server/training_job.h"

namespace httplib {
class Server;
}

namespace dbs {

// The status page's HTML (server/status_page.cc).
extern const char kStatusPageHtml[];

class StatusHttpServer {
 public:
  // Listens on host:port (0: any free port). `job`, `metrics` and `clock` must outlive it.
  static absl::StatusOr<std::unique_ptr<StatusHttpServer>> Start(const std::string& host, int port,
                                                                 TrainingJob* job, Metrics* metrics,
                                                                 const Clock* clock);
  ~StatusHttpServer();

  int port() const { return port_; }

 private:
  StatusHttpServer() = default;

  std::unique_ptr<httplib::Server> http_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace dbs

#endif  // DBS_SERVER_STATUS_HTTP_H_
