#include "ps/heartbeats.h"

#include <memory>

#include "common/log.h"
#include "ps/protocol.h"

namespace limbo::ps {

Heartbeats::Heartbeats(Transport& t, std::vector<std::string> endpoints, uint32_t learner,
                       std::chrono::milliseconds interval)
    : thread_([this, &t, endpoints = std::move(endpoints), learner, interval] {
        run(t, endpoints, learner, interval);
      }) {}

Heartbeats::~Heartbeats() {
  stop_ = true;
  thread_.join();
}

void Heartbeats::run(Transport& t, const std::vector<std::string>& endpoints, uint32_t learner,
                     std::chrono::milliseconds interval) {
  try {
    std::vector<std::unique_ptr<Socket>> socks;
    for (const auto& e : endpoints) {
      socks.push_back(std::make_unique<Socket>(t, Socket::Kind::Dealer));
      socks.back()->connect(e);
    }
    uint64_t seq = uint64_t{1} << 62;  // apart from the training thread's numbers
    std::vector<Frame> frames;
    while (!stop_) {
      for (size_t k = 0; k < socks.size(); ++k) {
        Header h;
        h.type = MsgType::Heartbeat;
        h.sender = learner;
        h.shard = static_cast<uint32_t>(k);
        h.seq = ++seq;
        socks[k]->send(nullptr, h, "", nullptr, 0);
        while (socks[k]->recv(frames, nullptr, 0)) {}  // answers are not needed
      }
      for (auto slept = std::chrono::milliseconds(0); slept < interval && !stop_;
           slept += std::chrono::milliseconds(50))
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  } catch (const std::exception& e) {
    log_warn(std::string("learner heartbeats stopped: ") + e.what());
  }
}

}  // namespace limbo::ps
