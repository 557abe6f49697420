# limbo_includes_torch(<file> <out>): whether <file>, or a header of this
# project it includes (quoted includes, followed recursively), includes a
# libtorch header. Results are remembered for the configure run.
function(limbo_includes_torch file out)
  get_property(known GLOBAL PROPERTY "limbo_torch_${file}" SET)
  if(known)
    get_property(v GLOBAL PROPERTY "limbo_torch_${file}")
    set(${out} ${v} PARENT_SCOPE)
    return()
  endif()
  set_property(GLOBAL PROPERTY "limbo_torch_${file}" FALSE)  # (an include cycle ends here)
  file(STRINGS "${file}" lines REGEX "^[ \t]*#[ \t]*include")
  set(found FALSE)
  get_filename_component(dir "${file}" DIRECTORY)
  foreach(line IN LISTS lines)
    if(line MATCHES "<(torch|ATen|c10|pybind11)/")
      set(found TRUE)
      break()
    endif()
    if(line MATCHES "\"([^\"]+)\"")
      set(inc "${CMAKE_MATCH_1}")
      foreach(base "${dir}" "${PROJECT_SOURCE_DIR}/src" "${PROJECT_SOURCE_DIR}/tests")
        if(EXISTS "${base}/${inc}")
          limbo_includes_torch("${base}/${inc}" sub)
          if(sub)
            set(found TRUE)
          endif()
          break()
        endif()
      endforeach()
      if(found)
        break()
      endif()
    endif()
  endforeach()
  set_property(GLOBAL PROPERTY "limbo_torch_${file}" ${found})
  set(${out} ${found} PARENT_SCOPE)
endfunction()

# limbo_torch_target(<target>): compile flags + shared libtorch PCH. The
# sources that include no libtorch header skip the PCH: loading it cost
# such a file some 11 s of its 16 (a test of the coordinator compiled in 5 s
# without it), and most of the build is such costs.
function(limbo_torch_target target)
  target_link_libraries(${target} PUBLIC ${TORCH_LIBRARIES})
  target_compile_options(${target} PRIVATE -fPIC -Wall -Wextra -Wno-unused-parameter)
  if(LIMBO_USE_PCH)
    target_precompile_headers(${target} REUSE_FROM limbo_pch)
    get_target_property(sources ${target} SOURCES)
    get_target_property(source_dir ${target} SOURCE_DIR)
    foreach(src IN LISTS sources)
      if(NOT src MATCHES "\\.cc$")
        continue()
      endif()
      if(IS_ABSOLUTE "${src}")
        set(path "${src}")
      else()
        set(path "${source_dir}/${src}")
      endif()
      limbo_includes_torch("${path}" needs)
      if(NOT needs)
        set_source_files_properties("${src}" TARGET_DIRECTORY ${target} PROPERTIES SKIP_PRECOMPILE_HEADERS ON)
      endif()
    endforeach()
  endif()
endfunction()

# limbo_add_test(<name> SOURCES ... LIBS ... [SERIAL]): one GoogleTest
# executable per test file, registered with CTest test by test. SERIAL tests
# run alone (they compare timings of real processes with a model). A test
# takes two ctest slots (one core; tests/cores.cmake gives those that mostly
# wait one).
function(limbo_add_test name)
  cmake_parse_arguments(T "SERIAL" "TIMEOUT" "SOURCES;LIBS" ${ARGN})
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE ${T_LIBS} GTest::gtest GTest::gtest_main)
  limbo_torch_target(${name})
  # A test's own code at -O1 (the libraries it runs stay at -O3): a file
  # that includes libtorch compiles in about 0.8 of the time (test_sharded.cc
  # 20.4 s against 25.0), and the libtorch PCH, built at -O3, stays valid
  # (what GCC checks is __OPTIMIZE__, defined at both). No -ffast-math
  # either way, so floats come out the same bits.
  target_compile_options(${name} PRIVATE -O1)
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
                       PROPERTIES TIMEOUT ${T_TIMEOUT} RUN_SERIAL ${serial} PROCESSORS 2
                                  SKIP_REGULAR_EXPRESSION "\\[  SKIPPED \\]")
endfunction()
