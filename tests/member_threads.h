// Members of a group as threads of the test process: one embedded store,
// one thread per member, each member's exception kept as its error.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/collective.h"
#include "comm/store.h"

namespace limbo::testing {

// Runs body(rank, options) on `world` threads against one store; the
// options name that store, with a 20 s timeout, for the groups body forms.
// Returns each member's error ("" for none), in rank order.
inline std::vector<std::string> on_member_threads(int world,
                                                  const std::function<void(int, comm::GroupOptions)>& body) {
  comm::StoreServer store("127.0.0.1", 0);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(world);
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        comm::GroupOptions go;
        go.store_port = store.port();
        go.timeout = std::chrono::milliseconds(20000);
        body(r, go);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

inline void expect_no_member_errors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "member " << r;
}

// Each of `world` threads a member of one Gloo group (prefix `prefix`);
// every member must end without an error.
inline void with_gloo_members(int world, const std::string& prefix,
                              const std::function<void(int, std::shared_ptr<comm::Collective>)>& fn) {
  expect_no_member_errors(on_member_threads(world, [&](int r, comm::GroupOptions go) {
    go.prefix = prefix;
    fn(r, comm::make_gloo_group(go, r, world));
  }));
}

}  // namespace limbo::testing
