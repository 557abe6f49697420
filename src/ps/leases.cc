#include "ps/leases.h"

#include <algorithm>

#include "common/error.h"

namespace limbo::ps {

LeaseBook::LeaseBook(int64_t dataset_size, int64_t batch, int64_t epochs)
    : n_(dataset_size), batch_(batch), epochs_(epochs) {
  if (n_ < 1 || batch_ < 1 || epochs_ < 1)
    throw InvalidInput("lease book needs a non-empty dataset, batch >= 1 and epochs >= 1");
}

LeaseBook::Next LeaseBook::next(uint32_t learner, Lease& lease) {
  // A learner works on one batch at a time: asking again means any lease it
  // still holds was abandoned (e.g. its reply was lost); hand that out again.
  release(learner);
  if (!queue_.empty()) {
    lease = queue_.front();
    queue_.pop_front();
  } else if (cursor_.epoch < epochs_) {
    lease = Lease{};
    lease.epoch = cursor_.epoch;
    lease.position = cursor_.position;
    lease.count = std::min(batch_, n_ - cursor_.position);
    cursor_.position += lease.count;
    if (cursor_.position >= n_) cursor_ = {cursor_.epoch + 1, 0};
  } else {
    return open_.empty() ? Next::Done : Next::Wait;
  }
  lease.id = next_id_++;
  lease.learner = learner;
  open_[lease.id] = lease;
  return Next::Granted;
}

bool LeaseBook::complete(int64_t lease_id) {
  auto it = open_.find(lease_id);
  if (it == open_.end()) return false;
  completed_samples_ += it->second.count;
  open_.erase(it);
  return true;
}

int LeaseBook::release(uint32_t learner) {
  int n = 0;
  for (auto it = open_.begin(); it != open_.end();) {
    if (it->second.learner == learner) {
      queue_.push_back(it->second);
      it = open_.erase(it);
      ++n;
    } else {
      ++it;
    }
  }
  return n;
}

double LeaseBook::epoch_progress() const { return static_cast<double>(completed_samples_) / n_; }

LeaseBook::Snapshot LeaseBook::snapshot() const {
  Snapshot s{cursor_, completed_samples_, next_id_, queue_};
  for (const auto& [id, l] : open_) s.queued.push_back(l);
  return s;
}

void LeaseBook::restore(const Snapshot& s) {
  cursor_ = s.cursor;
  completed_samples_ = s.completed_samples;
  next_id_ = s.next_id;
  open_.clear();
  queue_ = s.queued;
}

}  // namespace limbo::ps
