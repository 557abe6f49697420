// The live status page of a job: an HTTP server (cpp-httplib) on threads of
// its own, read-only, serving
//   /             a page that redraws itself every second (Chart.js, served
//                 from the binary: works without network access)
//   /metrics      Prometheus text exposition format
//   /status.json  the same data for scripts (docs/status.md)
//   /chart.js     the charting library
// and a tail thread that reads the job's metrics files every 0.5 s into its
// Board. Training never waits for it: the trainer only appends to its
// metrics file, as it does without a status server.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "status/board.h"

namespace limbo::status {

// "HOST:PORT" -> (host, port); InvalidInput naming `flag` when malformed.
std::pair<std::string, int> parse_address(const std::string& s, const std::string& flag);

class Server {
 public:
  // Binds host:port (port 0: a free one) and starts serving. Throws
  // InvalidInput when the address cannot be bound.
  Server(std::shared_ptr<Board> board, const std::string& host, int port);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // http://HOST:PORT/
  std::string url() const;
  int port() const { return port_; }
  // Tails a metrics file (it may not exist yet).
  void watch(const std::string& path);
  // Tails every file in `dir` whose name ends with `suffix` (rescanned).
  void watch_dir(const std::string& dir, const std::string& suffix);
  // Adds url() as a line of `dir`/status.url (the directory is created;
  // one line per page: the launchers of a job that share a run directory
  // each add theirs, and `limbo status` tries the newest first).
  void write_url(const std::string& dir) const;
  Board& board() { return *board_; }

 private:
  void tail_loop();

  std::shared_ptr<Board> board_;
  std::string host_;
  int port_ = 0;
  struct Http;
  std::unique_ptr<Http> http_;
  std::thread serve_, tail_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> served_{false};  // the listening loop has returned
  std::mutex mu_;
  std::vector<Tail> tails_;
  std::vector<std::pair<std::string, std::string>> dirs_;
};

// The page (HTML + JavaScript) and Chart.js as served.
const std::string& page_html();
const std::string& chart_js();

}  // namespace limbo::status
