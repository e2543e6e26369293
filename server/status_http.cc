#include "server/status_http.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "httplib.h"

namespace dbs {

absl::StatusOr<std::unique_ptr<StatusHttpServer>> StatusHttpServer::Start(
    const std::string& host, int port, TrainingJob* job, Metrics* metrics, const Clock* clock) {
  std::unique_ptr<StatusHttpServer> s(new StatusHttpServer());
  s->http_ = std::make_unique<httplib::Server>();
  httplib::Server& http = *s->http_;
  http.Get("/metrics", [job, metrics](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics->Render(job->Run(), job->aggregator()->Progress()),
                    "text/plain; version=0.0.4; charset=utf-8");
  });
  http.Get("/status.json", [job, clock](const httplib::Request&, httplib::Response& res) {
    res.set_content(Metrics::Status(job->Run(), job->aggregator()->Progress(), clock->Now()).dump(),
                    "application/json");
  });
  http.Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(kStatusPageHtml, "text/html; charset=utf-8");
  });
  s->port_ = port == 0 ? http.bind_to_any_port(host) : (http.bind_to_port(host, port) ? port : -1);
  if (s->port_ <= 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", host, ":", port, " (in use?)"));
  }
  s->thread_ = std::thread([&http] { http.listen_after_bind(); });
  LOG(INFO) << "metrics and status page on http://" << host << ":" << s->port_ << "/";
  return s;
}

StatusHttpServer::~StatusHttpServer() {
  if (http_ != nullptr) http_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace dbs
