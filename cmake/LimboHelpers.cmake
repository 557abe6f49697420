# limbo_torch_target(<target>): compile flags + shared libtorch PCH.
function(limbo_torch_target target)
  target_link_libraries(${target} PUBLIC ${TORCH_LIBRARIES})
  target_compile_options(${target} PRIVATE -fPIC -Wall -Wextra -Wno-unused-parameter)
  if(LIMBO_USE_PCH)
    target_precompile_headers(${target} REUSE_FROM limbo_pch)
  endif()
endfunction()

# limbo_add_test(<name> SOURCES ... LIBS ... [SERIAL]): one GoogleTest
# executable per test file, registered with CTest test by test. SERIAL tests
# run alone (they compare timings of real processes with a model).
function(limbo_add_test name)
  cmake_parse_arguments(T "SERIAL" "TIMEOUT" "SOURCES;LIBS" ${ARGN})
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE ${T_LIBS} GTest::gtest GTest::gtest_main)
  limbo_torch_target(${name})
  target_compile_definitions(${name} PRIVATE
    LIMBO_BINARY="$<TARGET_FILE:limbo>"
    LIMBO_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  set(serial FALSE)
  if(T_SERIAL)
    set(serial TRUE)
  endif()
  # A GTEST_SKIP counts as skipped, not passed: scripts/run-tests.sh lists
  # every skip with its reason (and fails CI on one CI could have run).
  gtest_discover_tests(${name} DISCOVERY_TIMEOUT 60
                       PROPERTIES TIMEOUT ${T_TIMEOUT} RUN_SERIAL ${serial}
                                  SKIP_REGULAR_EXPRESSION "\\[  SKIPPED \\]")
endfunction()
