// The status page: the Board's view of metrics records, the Prometheus text
// it exposes (checked by a strict parser of the exposition format), the JSON
// schema, and an HTTP server that garbage, huge headers, slow clients and
// many connections do not break.
#include <gtest/gtest.h>
#include <httplib.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "common/files.h"
#include "common/error.h"
#include "status/server.h"
#include "test_util.h"

using namespace limbo;
using namespace limbo::status;
using json = nlohmann::json;

namespace {

// A strict reader of Prometheus's text format 0.0.4: every sample belongs to
// a family declared by HELP and TYPE before it, names and labels are well
// formed, values parse, histogram buckets are cumulative and end with
// le="+Inf" equal to _count. Returns "" or the first problem.
struct Sample {
  std::string name, labels;
  double value;
};
std::string check_exposition(const std::string& text, std::map<std::string, std::string>* types,
                             std::vector<Sample>* samples) {
  static const std::regex help(R"(^# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) .+$)");
  static const std::regex type(R"(^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|histogram|summary|untyped)$)");
  static const std::regex line(
      R"(^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*"(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*")*)\})? (\S+)$)");
  std::istringstream in(text);
  std::set<std::string> helped;
  if (text.empty() || text.back() != '\n') return "does not end with a newline";
  for (std::string l; std::getline(in, l);) {
    std::smatch m;
    if (std::regex_match(l, m, help)) {
      helped.insert(m[1]);
      continue;
    }
    if (std::regex_match(l, m, type)) {
      if (!helped.count(m[1])) return "TYPE before HELP for " + m[1].str();
      if (types->count(m[1])) return "family declared twice: " + m[1].str();
      (*types)[m[1]] = m[2];
      continue;
    }
    if (!std::regex_match(l, m, line)) return "malformed line: '" + l + "'";
    std::string name = m[1], family = name;
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      const std::string s = suffix;
      if (name.size() > s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0 &&
          types->count(name.substr(0, name.size() - s.size())) &&
          (*types)[name.substr(0, name.size() - s.size())] == "histogram")
        family = name.substr(0, name.size() - s.size());
    }
    if (!types->count(family)) return "sample without a TYPE: " + name;
    if ((*types)[family] == "counter" && name.size() > 6 && name.substr(name.size() - 6) != "_total")
      return "counter not named *_total: " + name;
    double v;
    const std::string vs = m[4];
    if (vs == "+Inf") v = INFINITY;
    else if (vs == "-Inf") v = -INFINITY;
    else if (vs == "NaN") v = NAN;
    else {
      size_t used = 0;
      try {
        v = std::stod(vs, &used);
      } catch (...) {
        return "bad value: '" + l + "'";
      }
      if (used != vs.size()) return "bad value: '" + l + "'";
    }
    samples->push_back({name, m[3], v});
  }
  for (const auto& [family, t] : *types) {
    if (t != "histogram") continue;
    double last = -1, inf = -1, count = -1;
    bool seen_sum = false;
    for (const auto& s : *samples) {
      if (s.name == family + "_bucket") {
        if (s.value < last) return "histogram buckets not cumulative in " + family;
        last = s.value;
        if (s.labels.find("le=\"+Inf\"") != std::string::npos) inf = s.value;
      }
      if (s.name == family + "_count") count = s.value;
      if (s.name == family + "_sum") seen_sum = true;
    }
    if (inf < 0 || count < 0 || !seen_sum) return "histogram " + family + " lacks +Inf, _sum or _count";
    if (inf != count) return "histogram " + family + ": +Inf bucket != _count";
  }
  return "";
}

double value_of(const std::vector<Sample>& s, const std::string& name) {
  for (const auto& x : s)
    if (x.name == name) return x.value;
  return NAN;
}

std::shared_ptr<Board> elastic_board() {
  auto bp = std::make_shared<Board>("elastic");
  Board& b = *bp;
  b.member_event(3, "start", "joined 1,2,3");
  b.add_record({{"kind", "train"}, {"step", 50}, {"epoch", 0.5}, {"loss", 1.25}, {"lr", 0.04},
                {"lr_multiplier", 1.75}, {"batch_size", 192}, {"samples", 9600}, {"skipped_steps", 2},
                {"samples_per_second", 6000.0}, {"grad_norm", 3.5}});
  b.add_record({{"kind", "eval"}, {"step", 50}, {"test_accuracy", 0.8}, {"test_loss", 0.5}});
  b.add_record({{"kind", "isgd_epoch"}, {"triggered", 3}, {"extra_iterations", 9}});
  b.member_event(2, "hang", "lost 2");
  b.add_record({{"kind", "membership"}, {"world", 7}});  // ignored: the launcher reports membership
  b.add_record({{"kind", "something-new"}, {"x", 1}});   // unknown kinds are ignored
  return bp;
}

TEST(StatusBoard, SnapshotFollowsTheRecordsAndTheSchema) {
  auto bp = elastic_board();
  Board& b = *bp;
  json s = b.snapshot();
  EXPECT_EQ(s["job"], "elastic");
  EXPECT_EQ(s["members"], 2);
  EXPECT_EQ(s["step"], 50);
  EXPECT_EQ(s["samples_total"], 9600);
  EXPECT_EQ(s["skipped_steps"], 2);
  EXPECT_DOUBLE_EQ(s["lr_multiplier"].get<double>(), 1.75);
  EXPECT_DOUBLE_EQ(s["grad_norm"].get<double>(), 3.5);
  EXPECT_DOUBLE_EQ(s["series"]["grad_norm"].back().get<double>(), 3.5);
  EXPECT_DOUBLE_EQ(s["test_accuracy"].get<double>(), 0.8);
  EXPECT_EQ(s["isgd"]["triggers_total"], 3);
  EXPECT_TRUE(s["ps"].is_null());
  ASSERT_EQ(s["events"].size(), 2u);
  EXPECT_EQ(s["events"][1]["kind"], "hang");
  EXPECT_EQ(s["membership_changes"]["hang"], 1);
  // Schema: every documented key with its type (docs/status.md).
  const std::map<std::string, json::value_t> keys = {
      {"job", json::value_t::string}, {"uptime_seconds", json::value_t::number_float},
      {"time", json::value_t::number_float}, {"members", json::value_t::number_integer},
      {"step", json::value_t::number_integer}, {"epoch", json::value_t::number_float},
      {"samples_total", json::value_t::number_integer}, {"skipped_steps", json::value_t::number_integer},
      {"series", json::value_t::object},
      {"accuracy", json::value_t::object}, {"events", json::value_t::array},
      {"membership_changes", json::value_t::object}};
  for (const auto& [k, t] : keys) {
    ASSERT_TRUE(s.contains(k)) << k;
    EXPECT_EQ(s[k].type(), t) << k << ": " << s[k].dump();
  }
  for (const char* k : {"samples_per_second", "loss", "lr", "lr_multiplier", "batch_size", "test_accuracy",
                        "test_loss", "isgd", "ps", "diloco"})
    EXPECT_TRUE(s.contains(k)) << k;
  // Series are aligned arrays.
  const size_t n = s["series"]["t"].size();
  EXPECT_GE(n, 3u);
  for (const auto& [k, v] : s["series"].items()) EXPECT_EQ(v.size(), n) << k;
}

TEST(StatusBoard, PrometheusTextParsesAndCarriesTheRequiredMetrics) {
  auto bp = elastic_board();
  Board& b = *bp;
  std::map<std::string, std::string> types;
  std::vector<Sample> samples;
  ASSERT_EQ(check_exposition(b.prometheus(), &types, &samples), "") << b.prometheus();
  EXPECT_EQ(types["limbo_members"], "gauge");
  EXPECT_EQ(types["limbo_samples_total"], "counter");
  EXPECT_EQ(value_of(samples, "limbo_members"), 2);
  EXPECT_EQ(value_of(samples, "limbo_samples_total"), 9600);
  EXPECT_EQ(value_of(samples, "limbo_isgd_triggers_total"), 3);
  EXPECT_EQ(types["limbo_skipped_steps_total"], "counter");
  EXPECT_EQ(value_of(samples, "limbo_skipped_steps_total"), 2);
  EXPECT_EQ(types["limbo_grad_norm"], "gauge");
  EXPECT_EQ(value_of(samples, "limbo_grad_norm"), 3.5);
  EXPECT_EQ(types.count("limbo_staleness"), 0u);  // not a parameter-server job
}

// Token-stream jobs report the validation perplexity: in the snapshot, its
// series and /metrics; other jobs have none (null, no sample).
TEST(StatusBoard, TokenJobsShowTheirPerplexity) {
  Board b("train");
  b.add_record({{"kind", "eval"}, {"step", 10}, {"test_accuracy", 0.3}, {"test_loss", 2.0},
                {"test_perplexity", 7.389}});
  b.add_record({{"kind", "eval"}, {"step", 20}, {"test_accuracy", 0.4}, {"test_loss", 1.5},
                {"test_perplexity", 4.482}});
  json s = b.snapshot();
  EXPECT_DOUBLE_EQ(s["test_perplexity"].get<double>(), 4.482);
  ASSERT_EQ(s["accuracy"]["test_perplexity"].size(), 2u);
  EXPECT_DOUBLE_EQ(s["accuracy"]["test_perplexity"][0].get<double>(), 7.389);
  std::map<std::string, std::string> types;
  std::vector<Sample> samples;
  ASSERT_EQ(check_exposition(b.prometheus(), &types, &samples), "") << b.prometheus();
  EXPECT_EQ(types["limbo_test_perplexity"], "gauge");
  EXPECT_EQ(value_of(samples, "limbo_test_perplexity"), 4.482);
  EXPECT_EQ(value_of(samples, "limbo_test_loss"), 1.5);
  auto image = elastic_board();
  EXPECT_TRUE(image->snapshot()["test_perplexity"].is_null());
  std::map<std::string, std::string> image_types;
  std::vector<Sample> none;
  ASSERT_EQ(check_exposition(image->prometheus(), &image_types, &none), "");
  EXPECT_TRUE(std::isnan(value_of(none, "limbo_test_perplexity")));
}

// Shares of the batch by pace (elastic.shares = "pace"): the newest train
// record's shares and paces by rank are in the snapshot, null in a job
// without them, and a record without them keeps the last ones.
TEST(StatusBoard, SharesAndPacesByRankFollowTheTrainRecords) {
  auto none = elastic_board();
  EXPECT_TRUE(none->snapshot()["shares"].is_null());
  EXPECT_TRUE(none->snapshot()["paces"].is_null());
  Board b("elastic");
  b.add_record({{"kind", "train"}, {"step", 8}, {"shares", {0.5, 0.5}}});
  b.add_record({{"kind", "train"}, {"step", 40}, {"shares", {0.7, 0.3}}, {"paces", {40500.0, 17250.5}}});
  b.add_record({{"kind", "train"}, {"step", 50}});
  json s = b.snapshot();
  ASSERT_EQ(s["shares"].size(), 2u);
  EXPECT_DOUBLE_EQ(s["shares"][1].get<double>(), 0.3);
  EXPECT_DOUBLE_EQ(s["paces"][0].get<double>(), 40500.0);
  b.add_record({{"kind", "train"}, {"step", 60}, {"shares", "not a list"}});
  EXPECT_DOUBLE_EQ(b.snapshot()["shares"][0].get<double>(), 0.7);
}

// DiLoCo's outer records (docs/diloco.md): outer steps, the pseudo-gradient
// norm, the compute share and the bytes on the wire, in the snapshot's
// series and as Prometheus metrics; absent from other jobs.
TEST(StatusBoard, DilocoOuterStepsShowTheirNormUtilisationAndBytes) {
  Board b("elastic");
  b.member_event(2, "start", "joined 1,2");
  b.add_record({{"kind", "outer"}, {"step", 1}, {"epoch", 0.1}, {"samples", 640}, {"loss", 2.5}, {"owed", 0},
                {"pseudo_gradient_norm", 3.0}, {"compute_share", 0.9}, {"wall_seconds", 2.0},
                {"payload_bytes", 1000}, {"workers", 2}});
  b.add_record({{"kind", "outer"}, {"step", 2}, {"epoch", 0.2}, {"samples", 320}, {"loss", 2.0}, {"owed", 320},
                {"pseudo_gradient_norm", 2.0}, {"compute_share", 0.95}, {"wall_seconds", 1.0},
                {"payload_bytes", 1000}, {"workers", 1}});
  json s = b.snapshot();
  ASSERT_FALSE(s["diloco"].is_null());
  EXPECT_EQ(s["diloco"]["outer_steps"], 2);
  EXPECT_EQ(s["diloco"]["pseudo_gradient_bytes_total"], 2000);
  EXPECT_EQ(s["diloco"]["owed_samples"], 320);
  EXPECT_DOUBLE_EQ(s["diloco"]["compute_share"].get<double>(), 0.95);
  EXPECT_EQ(s["samples_total"], 960);
  EXPECT_DOUBLE_EQ(s["loss"].get<double>(), 2.0);
  // A point for the start (no outer step yet), then one an outer step.
  const auto& norms = s["series"]["pseudo_gradient_norm"];
  ASSERT_EQ(norms.size(), 3u);
  EXPECT_TRUE(norms[0].is_null());
  EXPECT_DOUBLE_EQ(norms[1].get<double>(), 3.0);
  EXPECT_DOUBLE_EQ(s["series"]["compute_share"][2].get<double>(), 0.95);
  std::map<std::string, std::string> types;
  std::vector<Sample> samples;
  ASSERT_EQ(check_exposition(b.prometheus(), &types, &samples), "") << b.prometheus();
  EXPECT_EQ(types["limbo_diloco_outer_steps_total"], "counter");
  EXPECT_EQ(value_of(samples, "limbo_diloco_outer_steps_total"), 2);
  EXPECT_EQ(value_of(samples, "limbo_diloco_pseudo_gradient_norm"), 2.0);
  EXPECT_EQ(value_of(samples, "limbo_diloco_pseudo_gradient_bytes_total"), 2000);
  EXPECT_TRUE(elastic_board()->snapshot()["diloco"].is_null());
  std::map<std::string, std::string> other_types;
  std::vector<Sample> none;
  ASSERT_EQ(check_exposition(elastic_board()->prometheus(), &other_types, &none), "");
  EXPECT_TRUE(std::isnan(value_of(none, "limbo_diloco_outer_steps_total")));
}

TEST(StatusBoard, ParameterServerRecordsGiveAStalenessHistogram) {
  Board b("async");
  b.member_event(3, "start", "3 learners");
  b.add_record({{"kind", "ps_updates"}, {"shard", 0}, {"clock", 100}, {"updates", 100}, {"updates_per_second", 50.0},
                {"busy_fraction", 0.25}, {"learners", 3}, {"staleness_hist", {{"0", 10}, {"1", 60}, {"3", 30}}},
                {"accepted", 300}, {"dropped", 2}, {"rejected", 1}});
  b.add_record({{"kind", "ps_updates"}, {"shard", 1}, {"clock", 100}, {"updates", 100}, {"updates_per_second", 49.0},
                {"busy_fraction", 0.5}, {"learners", 3}, {"staleness_hist", {{"0", 10}, {"1", 60}, {"3", 30}}},
                {"accepted", 300}, {"dropped", 2}, {"rejected", 4}});
  b.add_record({{"kind", "learner"}, {"learner", 0}, {"step", 40}, {"samples", 2560}, {"loss", 1.0},
                {"samples_per_second", 1000.0}});
  b.add_record({{"kind", "learner"}, {"learner", 1}, {"step", 40}, {"samples", 2560}, {"loss", 2.0},
                {"samples_per_second", 1500.0}});
  json s = b.snapshot();
  EXPECT_EQ(s["members"], 3);
  EXPECT_DOUBLE_EQ(s["samples_per_second"].get<double>(), 2500.0);
  EXPECT_DOUBLE_EQ(s["loss"].get<double>(), 1.5);
  EXPECT_EQ(s["ps"]["staleness_hist"]["1"], 60);  // shard 0's count, not doubled
  EXPECT_EQ(s["ps"]["gradients_rejected"], 5);
  EXPECT_EQ(s["ps"]["shards"].size(), 2u);
  std::map<std::string, std::string> types;
  std::vector<Sample> samples;
  ASSERT_EQ(check_exposition(b.prometheus(), &types, &samples), "") << b.prometheus();
  EXPECT_EQ(types["limbo_staleness"], "histogram");
  EXPECT_EQ(value_of(samples, "limbo_staleness_count"), 100);
  EXPECT_EQ(value_of(samples, "limbo_staleness_sum"), 60 + 90);
  EXPECT_EQ(value_of(samples, "limbo_samples_total"), 5120);
}

TEST(StatusBoard, SeriesStayBoundedOnLongJobs) {
  Board b("train");
  for (int i = 1; i <= 5000; ++i) b.add_record({{"kind", "train"}, {"step", i}, {"batch_size", 64}, {"loss", 1.0}});
  json s = b.snapshot();
  EXPECT_LE(s["series"]["t"].size(), Board::kMaxPoints);
  EXPECT_EQ(s["samples_total"], 5000 * 64);
}

// Found: a learner whose loss became NaN wrote "loss": null, and the board's
// typed read threw in the tail thread and killed the launcher. Records of any
// shape are taken for what they hold and never stop the board.
TEST(StatusBoard, RecordsWithNullsOrWrongTypesNeverStopIt) {
  Board b("async");
  const std::vector<json> odd = {
      json::parse(R"({"kind":"learner","learner":0,"step":5,"samples":320,"loss":null,"samples_per_second":"fast"})"),
      json::parse(R"({"kind":"train","step":"x","loss":null,"lr":"high","batch_size":1.5,"samples":null})"),
      json::parse(R"({"kind":"ps_updates","shard":"a","learners":null,"staleness_hist":{"x":1,"-3":2,"2":"n","1":4}})"),
      json::parse(R"({"kind":"ps_updates","shard":0,"staleness_hist":[1,2]})"),
      json::parse(R"({"kind":"membership","world":"three","reason":7})"),
      json::parse(R"({"kind":"isgd_epoch","triggered":null})"),
      json::parse(R"({"kind":5})"), json::parse("[1,2,3]"), json::parse("null"), json::parse(R"("text")")};
  for (const auto& r : odd) EXPECT_NO_THROW(b.add_record(r)) << r.dump();
  json s;
  ASSERT_NO_THROW(s = b.snapshot());
  EXPECT_EQ(s["samples_total"], 320);
  EXPECT_TRUE(s["loss"].is_null() || s["loss"].is_number()) << s.dump();
  EXPECT_EQ(s["ps"]["staleness_hist"].size(), 1u) << s.dump();  // only "1": 4 is a real count
  std::map<std::string, std::string> types;
  std::vector<Sample> samples;
  EXPECT_EQ(check_exposition(b.prometheus(), &types, &samples), "") << b.prometheus();
}

TEST(StatusTail, ReadsCompleteNewLinesOnly) {
  limbo::testing::TempDir d;
  const std::string path = d.file("metrics.jsonl");
  Tail t(path);
  EXPECT_TRUE(t.read().empty());  // not there yet
  {
    std::ofstream f(path);
    f << "{\"kind\":\"train\",\"step\":1}\n{\"kind\":\"tr";
  }
  auto got = t.read();
  ASSERT_EQ(got.size(), 1u);
  {
    std::ofstream f(path, std::ios::app);
    f << "ain\",\"step\":2}\nnot json\n";
  }
  got = t.read();
  ASSERT_EQ(got.size(), 1u);  // the torn line completed; the bad one skipped
  EXPECT_EQ(got[0]["step"], 2);
}

// ---------- the HTTP server ----------


std::string raw_exchange(int port, const std::string& request) {
  int fd = limbo::testing::connect_loopback(port);
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof buf, 0)) > 0) out.append(buf, static_cast<size_t>(n));
  ::close(fd);
  return out;
}

void expect_serving(int port) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(5, 0);
  auto r = c.Get("/metrics");
  ASSERT_TRUE(r) << "the server stopped answering";
  EXPECT_EQ(r->status, 200);
  EXPECT_NE(r->body.find("limbo_members"), std::string::npos);
}

TEST(StatusServer, ServesThePageTheLibraryTheMetricsAndTheJson) {
  limbo::testing::TempDir d;
  Server s(elastic_board(), "127.0.0.1", 0);
  ASSERT_GT(s.port(), 0);
  s.write_url(d.path());
  EXPECT_EQ(limbo::testing::slurp(d.file("status.url")), s.url() + "\n");
  httplib::Client c("127.0.0.1", s.port());
  auto page = c.Get("/");
  ASSERT_TRUE(page);
  EXPECT_EQ(page->status, 200);
  EXPECT_NE(page->body.find("<script src=\"/chart.js\">"), std::string::npos);
  EXPECT_EQ(page->body.find("http://"), std::string::npos) << "the page must not load anything from the network";
  auto lib = c.Get("/chart.js");
  ASSERT_TRUE(lib);
  EXPECT_EQ(lib->body, chart_js());
  EXPECT_NE(lib->body.find("Chart.js v"), std::string::npos);
  auto m = c.Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_NE(m->get_header_value("Content-Type").find("text/plain; version=0.0.4"), std::string::npos);
  auto j = c.Get("/status.json");
  ASSERT_TRUE(j);
  EXPECT_EQ(json::parse(j->body)["members"], 2);
  auto post = c.Post("/metrics", "x", "text/plain");
  ASSERT_TRUE(post);
  EXPECT_EQ(post->status, 405);  // read-only
  EXPECT_EQ(c.Get("/nothing-here")->status, 404);
}

TEST(StatusServer, SurvivesGarbageHugeHeadersSlowClientsAndManyConnections) {
  Server s(elastic_board(), "127.0.0.1", 0);
  const int port = s.port();
  // Garbage instead of HTTP.
  std::string garbage(5000, '\0');
  for (size_t i = 0; i < garbage.size(); ++i) garbage[i] = static_cast<char>((i * 7919) % 251);
  raw_exchange(port, garbage + "\r\n\r\n");
  expect_serving(port);
  // A header line far beyond the limit, and a huge request line.
  std::string r = raw_exchange(port, "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(200000, 'a') + "\r\n\r\n");
  EXPECT_TRUE(r.empty() || r.find("HTTP/1.1 4") == 0) << r.substr(0, 80);
  r = raw_exchange(port, "GET /" + std::string(100000, 'a') + " HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_TRUE(r.empty() || r.find("HTTP/1.1 4") == 0) << r.substr(0, 80);
  expect_serving(port);
  // Slow clients: they send a byte now and then and hold their connection.
  std::vector<int> slow;
  for (int i = 0; i < 8; ++i) {
    slow.push_back(limbo::testing::connect_loopback(port));
    ::send(slow.back(), "GE", 2, MSG_NOSIGNAL);
  }
  expect_serving(port);  // others are still served meanwhile
  for (int fd : slow) ::close(fd);
  // Many connections at once, each with a real request.
  // (60 s of patience: in one CI run under the loaded suite, 4 of 100 did
  // not get an answer within 20 s; the failures name httplib's error.)
  std::vector<std::thread> many;
  std::atomic<int> ok{0};
  std::mutex errors_mu;
  std::map<std::string, int> errors;
  for (int i = 0; i < 100; ++i)
    many.emplace_back([&] {
      httplib::Client c("127.0.0.1", port);
      c.set_read_timeout(60, 0);
      c.set_connection_timeout(60, 0);
      auto res = c.Get("/status.json");
      if (res && res->status == 200) {
        ok += 1;
        return;
      }
      std::lock_guard<std::mutex> lock(errors_mu);
      errors[res ? "status " + std::to_string(res->status) : httplib::to_string(res.error())] += 1;
    });
  for (auto& t : many) t.join();
  std::string why;
  for (const auto& [e, n] : errors) why += e + " x" + std::to_string(n) + "; ";
  EXPECT_EQ(ok.load(), 100) << why;
  // And connections opened and dropped without a request.
  for (int i = 0; i < 200; ++i) ::close(limbo::testing::connect_loopback(port));
  expect_serving(port);
}

TEST(StatusServer, TailsTheMetricsFilesItWatches) {
  limbo::testing::TempDir d;
  Server s(std::make_shared<Board>("train"), "127.0.0.1", 0);
  s.watch(d.file("metrics.jsonl"));
  s.watch_dir(d.file("learners"), ".jsonl");
  limbo::make_dirs(d.file("learners"));
  {
    std::ofstream(d.file("metrics.jsonl")) << R"({"kind":"train","step":10,"batch_size":8,"samples":80,"loss":2.0})" << "\n";
    std::ofstream(d.file("learners/3.jsonl")) << R"({"kind":"learner","learner":3,"samples":500,"samples_per_second":9.0})" << "\n";
  }
  json snap;
  for (int i = 0; i < 100; ++i) {
    snap = s.board().snapshot();
    if (snap["samples_total"] == 500) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(snap["samples_total"], 500) << snap.dump();
  EXPECT_EQ(snap["step"], 10);
}

// Found under load: a server destroyed right after it was made hung in its
// destructor (httplib's stop() does nothing until its loop runs).
TEST(StatusServer, AServerDestroyedAtOnceStops) {
  for (int i = 0; i < 50; ++i) Server s(std::make_shared<Board>("train"), "127.0.0.1", 0);
}

TEST(StatusServer, BadAddressesAreRefusedClearly) {
  EXPECT_THROW(parse_address("localhost", "--status"), InvalidInput);
  EXPECT_THROW(parse_address("127.0.0.1:70000", "--status"), InvalidInput);
  EXPECT_THROW(parse_address("127.0.0.1:12ab", "--status"), InvalidInput);
  EXPECT_EQ(parse_address("0.0.0.0:0", "--status").second, 0);
  Server taken(std::make_shared<Board>("train"), "127.0.0.1", 0);
  try {
    Server again(std::make_shared<Board>("train"), "127.0.0.1", taken.port());
    FAIL() << "bound a port that is taken";
  } catch (const InvalidInput& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(taken.port())), std::string::npos) << e.what();
  }
}

}  // namespace
