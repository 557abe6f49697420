#include "elastic/member.h"

#include <unistd.h>

#include <algorithm>

#include "common/error.h"
#include "common/log.h"

namespace limbo::elastic {

Member::Member(std::shared_ptr<comm::KvStore> store, MemberOptions opt)
    : store_(std::move(store)), opt_(std::move(opt)) {
  id_ = store_->add("elastic/next_id", 1);
  store_->add("elastic/hb/" + std::to_string(id_), 1);
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  store_->set("elastic/host_pid/" + std::to_string(id_), std::string(host) + ":" + std::to_string(::getpid()));
  store_->set("elastic/join/" + std::to_string(id_), "1");
  // The heartbeat has its own store connection so that a long store call on
  // the training thread cannot delay it.
  auto hb_store = comm::connect_kv_store(opt_.group.store_host, opt_.group.store_port,
                                         opt_.group.timeout);
  if (auto ms = store_->try_get("elastic/heartbeat_interval_ms"))
    opt_.heartbeat_interval = std::chrono::milliseconds(std::max<int64_t>(1, std::stoll(*ms)));
  heartbeat_ = std::thread([this, s = std::shared_ptr<comm::KvStore>(std::move(hb_store))] {
    auto next = std::chrono::steady_clock::now();
    while (!stop_) {
      try {
        beat_and_watch(*s);
      } catch (const std::exception& e) {
        log_warn(std::string("heartbeat: ") + e.what());
      }
      next += opt_.heartbeat_interval;
      const auto now = std::chrono::steady_clock::now();
      if (next < now) next = now;  // late (e.g. the process was stopped): no burst of beats
      while (!stop_ && std::chrono::steady_clock::now() < next)
        std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(
            next - std::chrono::steady_clock::now(), std::chrono::milliseconds(50)));
    }
  });
}

void Member::beat_and_watch(comm::KvStore& s) {
  s.add("elastic/hb/" + std::to_string(id_), 1);
  auto abort_at = s.try_get("elastic/abort");
  if (!abort_at) return;
  const int64_t k = std::stoll(*abort_at);
  std::shared_ptr<comm::Collective> g;
  {
    std::lock_guard<std::mutex> lock(group_mu_);
    if (group_round_ > 0 && k >= group_round_) {
      g = group_.lock();
      group_.reset();
    }
  }
  if (g) {
    log_warn("worker " + std::to_string(id_) + ": a member of round " + std::to_string(k) +
             " went silent; aborting the round's collectives");
    g->abort();
  }
}

Member::~Member() {
  stop_ = true;
  if (heartbeat_.joinable()) heartbeat_.join();
}

int Member::rank_in(const Round& round) const {
  auto it = std::find(round.members.begin(), round.members.end(), id_);
  return it == round.members.end() ? -1 : static_cast<int>(it - round.members.begin());
}

Round Member::wait_round(int64_t after) {
  auto deadline = std::chrono::steady_clock::now() + opt_.round_timeout;
  bool told = false;
  while (std::chrono::steady_clock::now() < deadline) {
    auto cur = store_->try_get("elastic/round");
    if (cur) {
      int64_t k = std::stoll(*cur);
      if (k > after) {
        auto m = store_->try_get("elastic/round/" + std::to_string(k));
        Round r{k, m ? parse_members(*m) : std::vector<int64_t>{}};
        if (rank_in(r) >= 0) return r;
        after = k;  // a round without us (e.g. over the maximum): wait for the next
      }
    }
    if (!told && std::chrono::steady_clock::now() + opt_.round_timeout - deadline >
                     std::chrono::seconds(5)) {
      log_info("worker " + std::to_string(id_) + ": waiting for a membership round (too few "
               "workers for the minimum?)");
      told = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  throw Timeout("worker " + std::to_string(id_) + " waited " +
                std::to_string(opt_.round_timeout.count() / 1000) +
                " s for a membership round; the job is below its minimum worker count or the "
                "launcher is gone");
}

bool Member::newer_round(int64_t current) {
  auto cur = store_->try_get("elastic/round");
  return cur && std::stoll(*cur) > current;
}

void Member::request_round(int64_t current) {
  store_->set("elastic/want/" + std::to_string(current), std::to_string(id_));
}

void Member::publish_progress(double epoch) {
  store_->set("elastic/progress", std::to_string(epoch));
}

void Member::publish_done() { store_->set("elastic/done", "1"); }

void Member::leave() { store_->set("elastic/left/" + std::to_string(id_), "1"); }

std::shared_ptr<comm::Collective> Member::form_group(const Round& round) {
  comm::GroupOptions go = opt_.group;
  go.prefix = "elastic/round/" + std::to_string(round.number);
  std::shared_ptr<comm::Collective> g =
      comm::make_gloo_group(go, rank_in(round), static_cast<int>(round.members.size()));
  std::lock_guard<std::mutex> lock(group_mu_);
  group_ = g;
  group_round_ = round.number;
  return g;
}

}  // namespace limbo::elastic
