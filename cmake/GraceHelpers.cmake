# grace_cc_library(NAME n [HDRS ...] [SRCS ...] [DEPS ...])
#   Defines grace_<n> with the alias grace::<n> (also its name when installed); its public
#   headers live in include/.
#   Without SRCS it is an INTERFACE library.
function(grace_cc_library)
  cmake_parse_arguments(ARG "" "NAME" "HDRS;SRCS;DEPS" ${ARGN})
  set(target grace_${ARG_NAME})
  set(include_dirs $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include>
                   $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  # C++20 is a usage requirement: grace's headers need it in every unit that includes them.
  if(ARG_SRCS)
    add_library(${target} STATIC ${ARG_SRCS} ${ARG_HDRS})
    target_include_directories(${target} PUBLIC ${include_dirs})
    target_link_libraries(${target} PUBLIC ${ARG_DEPS})
    target_compile_features(${target} PUBLIC cxx_std_20)
    # Position-independent unless the project chose otherwise, so that the static libraries
    # also link into shared libraries and plugins (measured: no change in grace-bench map).
    if(NOT DEFINED CMAKE_POSITION_INDEPENDENT_CODE)
      set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE ON)
    endif()
  else()
    add_library(${target} INTERFACE ${ARG_HDRS})
    target_include_directories(${target} INTERFACE ${include_dirs})
    target_link_libraries(${target} INTERFACE ${ARG_DEPS})
    target_compile_features(${target} INTERFACE cxx_std_20)
  endif()
  set_target_properties(${target} PROPERTIES EXPORT_NAME ${ARG_NAME})
  add_library(grace::${ARG_NAME} ALIAS ${target})
endfunction()

# grace_cc_test(NAME n SRCS ... [DEPS ...] [LABELS ...] [TIMEOUT s] [TEST_PREFIX p]
#               [TEST_FILTER f] [PROPERTIES name value ...])
#   One GoogleTest executable registered with CTest (each TEST a CTest case, its name
#   prefixed with p: the same sources built twice, against two variants of a library; and
#   only the tests that the --gtest_filter f selects, when given). PROPERTIES are set on
#   every case, after TIMEOUT and LABELS.
function(grace_cc_test)
  cmake_parse_arguments(ARG "" "NAME;TIMEOUT;TEST_PREFIX;TEST_FILTER" "SRCS;DEPS;LABELS;PROPERTIES"
                        ${ARGN})
  add_executable(${ARG_NAME} ${ARG_SRCS})
  target_link_libraries(${ARG_NAME} PRIVATE ${ARG_DEPS} grace_testing GTest::gtest_main)
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  if(NOT ARG_TEST_FILTER)
    set(ARG_TEST_FILTER "*")
  endif()
  gtest_discover_tests(${ARG_NAME} DISCOVERY_TIMEOUT 60 TEST_PREFIX "${ARG_TEST_PREFIX}"
                       TEST_FILTER "${ARG_TEST_FILTER}"
                       PROPERTIES TIMEOUT ${ARG_TIMEOUT} LABELS "${ARG_LABELS}" ${ARG_PROPERTIES})
endfunction()

# grace_cc_bench(NAME n SRCS ... [DEPS ...])
#   One Google Benchmark executable.
function(grace_cc_bench)
  cmake_parse_arguments(ARG "" "NAME" "SRCS;DEPS" ${ARGN})
  add_executable(${ARG_NAME} ${ARG_SRCS})
  target_link_libraries(${ARG_NAME} PRIVATE ${ARG_DEPS} benchmark::benchmark_main)
endfunction()
