# Builds and runs tests/package/consumer the way a service would use grace (cmake -P):
#   MODE=add_subdirectory  the consumer's CMake build adds grace's source tree;
#   MODE=find_package      grace's build (GRACE_BUILD_DIR) is installed to a fresh prefix, its
#                          files checked, and the consumer's CMake build finds it there;
#   MODE=pkg_config        the same install, and the consumer compiled by one compiler command
#                          with the flags `pkg-config --cflags --libs grace` gives.
# Also given: GRACE_SOURCE_DIR, WORK_DIR, GENERATOR, CXX_COMPILER, BUILD_TYPE.
cmake_minimum_required(VERSION 3.25)

function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE status OUTPUT_VARIABLE out
                  ERROR_VARIABLE out)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "${what} failed (${status}):\n${out}")
  endif()
  message(STATUS "${what}: ok")
endfunction()

# Installs grace's build under `prefix` and checks what a user's build needs is there.
function(install_grace prefix)
  run_step("install grace to ${prefix}"
           ${CMAKE_COMMAND} --install ${GRACE_BUILD_DIR} --prefix ${prefix})
  foreach(expected include/grace/map/hash_map.h include/grace/alloc/object_pool.h
                   include/grace/reclaim/domain.h include/grace/map/detail/split_list.h
                   lib/libgrace_map.a lib/libgrace_alloc.a lib/libgrace_reclaim.a
                   lib/cmake/grace/graceConfig.cmake lib/cmake/grace/graceConfigVersion.cmake
                   lib/cmake/grace/graceTargets.cmake lib/pkgconfig/grace.pc
                   share/doc/grace/LICENSE)
    if(NOT EXISTS ${prefix}/${expected})
      message(FATAL_ERROR "the install lacks ${expected}")
    endif()
  endforeach()
  file(GLOB_RECURSE internal_headers RELATIVE ${prefix} ${prefix}/*_internal.h)
  if(internal_headers)
    message(FATAL_ERROR "the install holds private headers: ${internal_headers}")
  endif()
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
set(consumer_args -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
                  -DCMAKE_BUILD_TYPE=${BUILD_TYPE} -DGRACE_CONSUME=${MODE})

if(MODE STREQUAL "add_subdirectory")
  list(APPEND consumer_args -DGRACE_SOURCE_DIR=${GRACE_SOURCE_DIR})
elseif(MODE STREQUAL "find_package")
  install_grace(${prefix})
  list(APPEND consumer_args -DCMAKE_PREFIX_PATH=${prefix} -DGRACE_EXPECTED_PREFIX=${prefix})
elseif(MODE STREQUAL "pkg_config")
  install_grace(${prefix})
  # The consumer's own pkg-config search path first, as a user who installed grace there
  # would set it; liburcu and abseil come from the system's.
  set(ENV{PKG_CONFIG_PATH} ${prefix}/lib/pkgconfig)
  execute_process(COMMAND pkg-config --cflags --libs grace RESULT_VARIABLE status
                  OUTPUT_VARIABLE flags ERROR_VARIABLE flags OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "pkg-config --cflags --libs grace failed:\n${flags}")
  endif()
  if(NOT flags MATCHES "-I${prefix}/lib/pkgconfig/\\.\\./\\.\\./include")
    message(FATAL_ERROR "pkg-config's flags do not point into ${prefix}: ${flags}")
  endif()
  separate_arguments(flags UNIX_COMMAND "${flags}")
  file(MAKE_DIRECTORY ${WORK_DIR}/build)
  run_step("compile and link the consumer with pkg-config's flags"
           ${CXX_COMPILER} -std=c++20 ${CMAKE_CURRENT_LIST_DIR}/consumer/main.cc ${flags}
                           -o ${WORK_DIR}/build/consumer)
  run_step("run the consumer" ${WORK_DIR}/build/consumer)
  return()
else()
  message(FATAL_ERROR "MODE must be add_subdirectory, find_package or pkg_config, not '${MODE}'")
endif()

run_step("configure the consumer"
         ${CMAKE_COMMAND} -S ${CMAKE_CURRENT_LIST_DIR}/consumer -B ${WORK_DIR}/build
                          ${consumer_args})
run_step("build the consumer" ${CMAKE_COMMAND} --build ${WORK_DIR}/build -j 2)
run_step("run the consumer" ${WORK_DIR}/build/consumer)
