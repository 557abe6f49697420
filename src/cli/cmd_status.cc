// `limbo status`: a compact terminal view of a running job, read from its
// status page's /status.json.
#include <httplib.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <memory>
#include <sstream>
#include <vector>
#include <thread>

#include "cli/commands.h"
#include "common/error.h"
#include "common/files.h"
#include "status/server.h"

namespace limbo::cli {
namespace {

using json = nlohmann::json;

// The pages to ask, best first: ADDR:PORT, or the lines of a run
// directory's status.url, newest first (every launcher of a job adds its
// page; the pages of lost hosts stay listed).
std::vector<std::pair<std::string, int>> addresses_of(const std::string& target) {
  std::vector<std::pair<std::string, int>> out;
  const std::string file = target + "/status.url";
  if (file_exists(file)) {
    std::istringstream in(read_file(file));
    for (std::string url; std::getline(in, url);) {
      while (!url.empty() && (url.back() == '/' || url.back() == ' ' || url.back() == '\r')) url.pop_back();
      if (url.empty()) continue;
      const std::string scheme = "http://";
      if (url.rfind(scheme, 0) != 0)
        throw InvalidInput(file + " does not hold an http:// address: '" + url + "'");
      out.insert(out.begin(), status::parse_address(url.substr(scheme.size()), file));
    }
    if (out.empty()) throw InvalidInput(file + " is empty");
    return out;
  }
  if (target.find(':') == std::string::npos)
    throw InvalidInput("'" + target + "' is neither ADDR:PORT nor a run directory with a status.url "
                       "(jobs started with `limbo launch`, or with --status, write one)");
  out.push_back(status::parse_address(target, "limbo status"));
  return out;
}

std::string num(const json& v, const char* fmt) {
  if (!v.is_number()) return "-";
  char b[64];
  std::snprintf(b, sizeof b, fmt, v.get<double>());
  return b;
}

std::string render(const json& s) {
  std::string o;
  o += "job " + s.value("job", std::string("?")) + ", up " + num(s["uptime_seconds"], "%.0f") + " s: " +
       std::to_string(s.value("members", 0)) + " members, epoch " + num(s["epoch"], "%.2f") + ", step " +
       std::to_string(s.value("step", int64_t{0})) + ", " + std::to_string(s.value("samples_total", int64_t{0})) +
       " samples\n";
  o += "  " + num(s["samples_per_second"], "%.0f") + " samples/s, loss " + num(s["loss"], "%.4f") +
       ", test accuracy " +
       (s["test_accuracy"].is_number() ? num(json(100 * s["test_accuracy"].get<double>()), "%.2f") + "%" : "-") + "\n";
  o += "  lr " + num(s["lr"], "%.5g") + ", multiplier " + num(s["lr_multiplier"], "%.3f") + ", global batch " +
       num(s["batch_size"], "%.0f") + "\n";
  if (s["ps"].is_object()) {
    const json& p = s["ps"];
    std::string hist;
    for (const auto& [tau, n] : p["staleness_hist"].items()) hist += " " + tau + ":" + std::to_string(n.get<int64_t>());
    o += "  parameter server: " + num(p["updates_per_second"], "%.1f") + " updates/s, " +
         std::to_string(p.value("updates_total", int64_t{0})) + " updates, dropped " +
         std::to_string(p.value("gradients_dropped", int64_t{0})) + ", refused " +
         std::to_string(p.value("gradients_rejected", int64_t{0})) + "\n  staleness (tau:count)" +
         (hist.empty() ? " -" : hist) + "\n";
    for (const auto& sh : p["shards"])
      o += "  shard " + std::to_string(sh.value("shard", 0)) + ": " + num(sh["updates_per_second"], "%.1f") +
           " updates/s, busy " + num(json(100 * sh.value("busy_fraction", 0.0)), "%.0f") + "%\n";
  }
  if (s["isgd"].is_object())
    o += "  ISGD: " + std::to_string(s["isgd"].value("triggers_total", int64_t{0})) + " triggers\n";
  const json& ev = s["events"];
  const size_t first = ev.size() > 3 ? ev.size() - 3 : 0;
  for (size_t i = first; i < ev.size(); ++i)
    o += "  " + num(ev[i]["t"], "%.1f") + " s: " + ev[i].value("kind", std::string()) + " -> " +
         std::to_string(ev[i].value("members", 0)) + " members (" + ev[i].value("detail", std::string()) + ")\n";
  return o;
}

}  // namespace

int run_status(const std::string& target, bool watch, double interval) {
  const auto pages = addresses_of(target);
  const bool tty = ::isatty(1);
  size_t at = 0;  // the page that answered last
  for (;;) {
    // The page that answered last first, then the others in order.
    std::unique_ptr<httplib::Response> res;
    std::string tried;
    for (size_t k = 0; k < pages.size() && !res; ++k) {
      const size_t i = (at + k) % pages.size();
      httplib::Client cli(pages[i].first, pages[i].second);
      cli.set_connection_timeout(2, 0);
      cli.set_read_timeout(5, 0);
      auto got = cli.Get("/status.json");
      if (got) {
        res = std::make_unique<httplib::Response>(got.value());
        at = i;
      } else {
        tried += std::string(tried.empty() ? "" : ", ") + pages[i].first + ":" + std::to_string(pages[i].second) +
                 " (" + httplib::to_string(got.error()) + ")";
      }
    }
    const std::string where = pages[at].first + ":" + std::to_string(pages[at].second);
    if (!res) {
      if (watch) {
        std::printf("no status page answers: %s; the job may have ended\n", tried.c_str());
        return kExitPeerFailure;
      }
      throw PeerFailure("no status page answers: " + tried + "; is the job still running?");
    }
    if (res->status != 200)
      throw PeerFailure(where + "/status.json answered HTTP " + std::to_string(res->status));
    json s;
    try {
      s = json::parse(res->body);
    } catch (const std::exception& e) {
      throw PeerFailure(where + " is not a Limbo status page (" + e.what() + ")");
    }
    if (watch && tty) std::fputs("\x1b[H\x1b[2J", stdout);  // home, clear
    std::fputs(render(s).c_str(), stdout);
    std::fflush(stdout);
    if (!watch) return kExitOk;
    std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(interval * 1000)));
  }
}

}  // namespace limbo::cli
