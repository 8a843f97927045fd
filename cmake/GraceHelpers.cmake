# grace_cc_library(NAME n HDRS ... SRCS ... [DEPS ...])
#   Defines grace_<n> with the alias grace::<n> (also its name when installed). HDRS are its
#   public headers, every one under include/ (configure fails naming one left out): a file set
#   that gives the include directory and is what `cmake --install` installs.
function(grace_cc_library)
  cmake_parse_arguments(ARG "" "NAME" "HDRS;SRCS;DEPS" ${ARGN})
  set(target grace_${ARG_NAME})
  file(GLOB_RECURSE present RELATIVE ${CMAKE_CURRENT_SOURCE_DIR} CONFIGURE_DEPENDS
       ${CMAKE_CURRENT_SOURCE_DIR}/include/*.h)
  foreach(header ${present})
    if(NOT header IN_LIST ARG_HDRS)
      message(FATAL_ERROR "${header} is not in grace_cc_library(NAME ${ARG_NAME} HDRS ...): "
                          "it would not be installed")
    endif()
  endforeach()
  add_library(${target} STATIC ${ARG_SRCS})
  # Position-independent unless the project chose otherwise, so that the static libraries
  # also link into shared libraries and plugins (measured: no change in grace-bench map).
  if(NOT DEFINED CMAKE_POSITION_INDEPENDENT_CODE)
    set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE ON)
  endif()
  target_sources(${target} PUBLIC FILE_SET HEADERS BASE_DIRS ${CMAKE_CURRENT_SOURCE_DIR}/include
                 FILES ${ARG_HDRS})
  target_link_libraries(${target} PUBLIC ${ARG_DEPS})
  # C++20 is a usage requirement: grace's headers need it in every unit that includes them.
  target_compile_features(${target} PUBLIC cxx_std_20)
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
