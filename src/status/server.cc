#include "status/server.h"

#include <httplib.h>

#include <dirent.h>

#include <chrono>
#include <set>

#include "common/error.h"
#include "common/files.h"
#include "common/log.h"

namespace limbo::status {

struct Server::Http {
  httplib::Server srv;
};

std::pair<std::string, int> parse_address(const std::string& s, const std::string& flag) {
  const auto colon = s.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == s.size())
    throw InvalidInput(flag + " expects ADDR:PORT (port 0 = any free port), got '" + s + "'");
  try {
    size_t used = 0;
    const int port = std::stoi(s.substr(colon + 1), &used);
    if (used != s.size() - colon - 1 || port < 0 || port > 65535) throw std::out_of_range("port");
    return {s.substr(0, colon), port};
  } catch (const std::exception&) {
    throw InvalidInput(flag + ": bad port in '" + s + "' (0-65535)");
  }
}

Server::Server(std::shared_ptr<Board> board, const std::string& host, int port)
    : board_(std::move(board)), host_(host), http_(std::make_unique<Http>()) {
  auto& srv = http_->srv;
  // Bounded work per connection: slow or idle clients are cut after 2 s and
  // hold one of 16 threads meanwhile; requests larger than httplib's limits
  // (8 KiB URI, 8 KiB per header line) are answered 414 / 400.
  srv.new_task_queue = [] { return new httplib::ThreadPool(16); };
  srv.set_read_timeout(2, 0);
  srv.set_write_timeout(2, 0);
  srv.set_keep_alive_max_count(20);
  srv.set_keep_alive_timeout(2);
  srv.set_payload_max_length(16 * 1024);
  // SO_REUSEADDR only: httplib's default also sets SO_REUSEPORT, which would
  // let a second server bind a port that is taken and share its clients.
  srv.set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  auto no_store = [](httplib::Response& res) { res.set_header("Cache-Control", "no-store"); };
  srv.Get("/", [no_store](const httplib::Request&, httplib::Response& res) {
    no_store(res);
    res.set_content(page_html(), "text/html; charset=utf-8");
  });
  srv.Get("/chart.js", [](const httplib::Request&, httplib::Response& res) {
    res.set_header("Cache-Control", "max-age=3600");
    res.set_content(chart_js(), "application/javascript");
  });
  srv.Get("/metrics", [this, no_store](const httplib::Request&, httplib::Response& res) {
    no_store(res);
    res.set_content(board_->prometheus(), "text/plain; version=0.0.4; charset=utf-8");
  });
  srv.Get("/status.json", [this, no_store](const httplib::Request&, httplib::Response& res) {
    no_store(res);
    res.set_content(board_->snapshot().dump(), "application/json");
  });
  // Read-only: any other method on a known path is refused.
  auto refuse = [](const httplib::Request&, httplib::Response& res) {
    res.status = 405;
    res.set_header("Allow", "GET, HEAD");
    res.set_content("method not allowed: this server is read-only\n", "text/plain");
  };
  for (const char* p : {"/", "/metrics", "/status.json", "/chart.js"}) {
    srv.Post(p, refuse);
    srv.Put(p, refuse);
    srv.Delete(p, refuse);
    srv.Patch(p, refuse);
  }
  srv.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
    res.status = 500;
    res.set_content("internal error\n", "text/plain");
  });
  port_ = port == 0 ? srv.bind_to_any_port(host) : (srv.bind_to_port(host, port) ? port : -1);
  if (port_ <= 0)
    throw InvalidInput("--status: cannot serve on " + host + ":" + std::to_string(port) +
                       " (address not on this machine, or the port is taken)");
  serve_ = std::thread([this] {
    http_->srv.listen_after_bind();
    served_ = true;
  });
  // httplib's stop() does nothing before the listening loop runs: wait for it,
  // so that a server destroyed at once still stops.
  while (!http_->srv.is_running() && !served_) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  tail_ = std::thread([this] { tail_loop(); });
}

Server::~Server() {
  stop_ = true;
  while (!served_) {
    http_->srv.stop();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (serve_.joinable()) serve_.join();
  if (tail_.joinable()) tail_.join();
}

std::string Server::url() const {
  return "http://" + (host_ == "0.0.0.0" ? std::string("127.0.0.1") : host_) + ":" + std::to_string(port_) + "/";
}

void Server::watch(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& t : tails_)
    if (t.path() == path) return;
  tails_.emplace_back(path);
}

void Server::watch_dir(const std::string& dir, const std::string& suffix) {
  std::lock_guard<std::mutex> lock(mu_);
  dirs_.emplace_back(dir, suffix);
}

void Server::write_url(const std::string& dir) const {
  make_dirs(dir);
  const std::string file = dir + "/status.url";
  if (file_exists(file) && ("\n" + read_file(file)).find("\n" + url() + "\n") != std::string::npos) return;
  append_line(file, url());
}

void Server::tail_loop() {
  while (!stop_) {
    std::vector<std::pair<std::string, std::string>> dirs;
    {
      std::lock_guard<std::mutex> lock(mu_);
      dirs = dirs_;
    }
    for (const auto& [dir, suffix] : dirs) {
      if (DIR* d = ::opendir(dir.c_str())) {
        while (dirent* e = ::readdir(d)) {
          const std::string name = e->d_name;
          if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
            watch(dir + "/" + name);
        }
        ::closedir(d);
      }
    }
    std::vector<nlohmann::json> records;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& t : tails_) {
        auto got = t.read();
        records.insert(records.end(), got.begin(), got.end());
      }
    }
    for (const auto& r : records) {
      try {
        board_->add_record(r);
      } catch (const std::exception& e) {  // a record of an unexpected shape: skipped, never fatal
        log_warn(std::string("status page: skipped a metrics record (") + e.what() + ")");
      }
    }
    for (int i = 0; i < 10 && !stop_; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

}  // namespace limbo::status
