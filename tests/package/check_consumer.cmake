# Builds and runs tests/package/consumer the way a service would use grace (cmake -P):
#   MODE=subdirectory  the consumer adds grace's source tree with add_subdirectory();
#   MODE=package       grace's build (GRACE_BUILD_DIR) is installed to a fresh prefix, its
#                      files checked, and the consumer finds it there with find_package().
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

file(REMOVE_RECURSE ${WORK_DIR})
set(consumer_args -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
                  -DCMAKE_BUILD_TYPE=${BUILD_TYPE} -DGRACE_CONSUME=${MODE})

if(MODE STREQUAL "subdirectory")
  list(APPEND consumer_args -DGRACE_SOURCE_DIR=${GRACE_SOURCE_DIR})
elseif(MODE STREQUAL "package")
  set(prefix ${WORK_DIR}/prefix)
  run_step("install grace to ${prefix}"
           ${CMAKE_COMMAND} --install ${GRACE_BUILD_DIR} --prefix ${prefix})
  foreach(expected include/grace/map/hash_map.h include/grace/alloc/object_pool.h
                   include/grace/reclaim/domain.h include/grace/map/detail/split_list.h
                   lib/libgrace_map.a lib/libgrace_alloc.a lib/libgrace_reclaim.a
                   lib/cmake/grace/graceConfig.cmake lib/cmake/grace/graceConfigVersion.cmake
                   lib/cmake/grace/graceTargets.cmake share/doc/grace/LICENSE)
    if(NOT EXISTS ${prefix}/${expected})
      message(FATAL_ERROR "the install lacks ${expected}")
    endif()
  endforeach()
  file(GLOB_RECURSE internal_headers RELATIVE ${prefix} ${prefix}/*_internal.h)
  if(internal_headers)
    message(FATAL_ERROR "the install holds private headers: ${internal_headers}")
  endif()
  list(APPEND consumer_args -DCMAKE_PREFIX_PATH=${prefix} -DGRACE_EXPECTED_PREFIX=${prefix})
else()
  message(FATAL_ERROR "MODE must be subdirectory or package, not '${MODE}'")
endif()

run_step("configure the consumer"
         ${CMAKE_COMMAND} -S ${CMAKE_CURRENT_LIST_DIR}/consumer -B ${WORK_DIR}/build
                          ${consumer_args})
run_step("build the consumer" ${CMAKE_COMMAND} --build ${WORK_DIR}/build -j 2)
run_step("run the consumer" ${WORK_DIR}/build/consumer)
