// train::Membership for elastic data-parallel training: rounds from the
// coordinator, a fresh Gloo group per round, state sync from the member with
// the newest committed step, and agreement on change steps through a flag
// carried by the gradient all-reduce.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "elastic/allreduce_update.h"
#include "elastic/member.h"
#include "train/membership.h"

namespace limbo::elastic {

// Makes every member of `g` hold the state of the member with the newest
// committed step (ties: the lowest rank). Returns that member's rank.
int sync_state(comm::Collective& g, train::SyncTargets& s);

// Whether this member writes its run directory (the lowest rank among the
// members on the same `storage`, RunDir::storage_id), and how many distinct
// storages (0 excluded) the group's members write to. `earlier`, when
// given, receives the ranks before this member's on the same storage.
std::pair<bool, int> storage_writer(comm::Collective& g, int64_t storage, std::vector<int>* earlier = nullptr);

// The fullest copy of the run's records (metrics.jsonl: the most records;
// ties, the lowest rank) for each writer whose storage holds fewer (a host
// that joined late, or one that left and came back: its copy has a gap),
// to replace its copy; empty for every other member. Two all-reduces of one
// number when no copy is behind.
std::string share_records(comm::Collective& g, const train::SyncTargets& s, bool writer);

// No member holds some shard of the optimizer state (or of the weights) at
// the newest committed step: a shard and its copy were lost together.
using ShardsLost = train::StateLost;
using StateLostForGood = train::StateLostForGood;

// The largest `value` among the members and the lowest rank holding it
// (any value a double holds exactly, negative ones too).
std::pair<double, int> max_and_rank(comm::Collective& g, double value);

struct ShardSync {
  int source = 0;              // the member whose step and small state everyone took
  int64_t bytes_sent = 0;      // weights and state this member contributed
  int64_t bytes_received = 0;  // state this member received (its new shard)
  double seconds = 0;
};

// sync_state() for sharded optimizer state: the weights and every shard of
// the newest committed step are assembled from the members' homes (their
// own and those of their host's members gone from `round`, dead or frozen,
// elastic/shards.h), the weights whole on every member and the state
// re-sharded for this group, each member receiving only its new shard.
// Throws ShardsLost when some shard is held by no member, and
// StateLostForGood when no member has a step left (after a fallback that
// found no checkpoint anywhere).
ShardSync sync_sharded_state(comm::Collective& g, train::SyncTargets& s, AllReduceUpdate& rule, const Round& round);

class ElasticMembership : public train::Membership {
 public:
  // `want_leave` is polled every step (e.g. a SIGTERM flag).
  ElasticMembership(std::unique_ptr<Member> member, std::shared_ptr<AllReduceUpdate> rule,
                    std::function<bool()> want_leave);
  Established establish(train::SyncTargets& s, const std::string& reason) override;
  bool change_agreed() override { return rule_->last_flag_sum() > 0; }
  bool leaving() override { return want_leave_(); }
  void leave() override { member_->leave(); }
  void publish_progress(double epoch) override { member_->publish_progress(epoch); }
  void publish_done() override { member_->publish_done(); }
  void publish_record(const nlohmann::json& record) override { member_->publish_record(record.dump()); }
  void publish_final(int64_t storage) override { member_->publish_final(storage); }
  bool wait_final(int64_t storage) override { return member_->wait_final(storage, earlier_on_storage_); }
  int64_t id() const { return member_->id(); }

 private:
  std::unique_ptr<Member> member_;
  std::shared_ptr<AllReduceUpdate> rule_;
  std::function<bool()> want_leave_;
  Round round_;
  std::vector<int64_t> earlier_on_storage_;  // ids of the members before this one on its storage
};

}  // namespace limbo::elastic
