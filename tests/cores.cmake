# Each test's PROCESSORS from the cores it keeps busy on average
# (tests/ctest_cores.txt: name, cores, slots; measured by
# scripts/test_cores.py). ctest counts two slots a core
# (scripts/run-tests.sh runs ctest -j <2 x cores>), so a test that mostly
# waits takes one slot and another runs beside it, and one that keeps a core
# busy (or more) takes two. A test not in the file takes two.
#
# Included twice: at configure time (end of tests/CMakeLists.txt) for the
# tests declared there, and by ctest (TEST_INCLUDE_FILES, after the files
# that declare the GoogleTest cases) for the discovered ones; each pass sets
# the tests that exist then (at configure time `if(TEST)` tells; ctest has
# no such test, and ignores a name it does not know).
file(STRINGS "${CMAKE_CURRENT_LIST_DIR}/ctest_cores.txt" limbo_cores_lines REGEX "^[^#]")
foreach(line IN LISTS limbo_cores_lines)
  string(REPLACE " " ";" fields "${line}")
  list(GET fields 0 name)
  list(GET fields 2 slots)
  if(NOT LIMBO_CONFIGURING)
    set_tests_properties("${name}" PROPERTIES PROCESSORS ${slots})
  elseif(TEST "${name}")
    set_tests_properties("${name}" PROPERTIES PROCESSORS ${slots})
  endif()
endforeach()

# Tests that hold a member to a fraction of a core (a cgroup cpu quota) and
# check its pace against another's: nothing else may take the cores then.
foreach(name Launch.SharesByPaceFollowAWorkerHeldToAFractionOfACore
             Python.Job.shares_by_pace_follow_a_member_held_to_a_fraction_of_a_core
             Python.Job.shares_by_pace_keep_every_sample_once_across_a_loss_and_a_join)
  if(NOT LIMBO_CONFIGURING)
    set_tests_properties("${name}" PROPERTIES RUN_SERIAL TRUE)
  elseif(TEST "${name}")
    set_tests_properties("${name}" PROPERTIES RUN_SERIAL TRUE)
  endif()
endforeach()
