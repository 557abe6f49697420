#include "elastic/serial_queue.h"

#include "common/process.h"

namespace limbo::elastic {

SerialQueue::~SerialQueue() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

int64_t SerialQueue::push(std::function<void()> job) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
  jobs_.push_back(std::move(job));
  cv_.notify_all();
  return pushed_++;
}

void SerialQueue::wait(int64_t ticket) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return finished_ > ticket; });
}

void SerialQueue::drain() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return finished_ == pushed_; });
}

std::exception_ptr SerialQueue::error() {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

void SerialQueue::reset() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return finished_ == pushed_; });
  error_ = nullptr;
}

void SerialQueue::loop() {
  name_this_thread("limbo-gather");
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
    if (jobs_.empty()) return;  // stopping, nothing left
    auto job = std::move(jobs_.front());
    jobs_.pop_front();
    const bool skip = error_ != nullptr;
    lock.unlock();
    std::exception_ptr err;
    if (!skip) {
      try {
        job();
      } catch (...) {
        err = std::current_exception();
      }
    }
    lock.lock();
    if (err && !error_) error_ = err;
    ++finished_;
    cv_.notify_all();
  }
}

}  // namespace limbo::elastic
