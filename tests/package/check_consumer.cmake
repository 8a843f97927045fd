# A service's use of grace, built from scratch and run (cmake -P; tests/package/CMakeLists.txt
# registers one test per MODE):
#   install           configures and builds grace's libraries alone, installs them to PREFIX
#                     (libraries in LIBDIR), checks the files a user's build needs, and
#                     compiles each installed header on its own;
#   add_subdirectory  consumer/'s CMake build adds grace's source tree;
#   find_package      consumer/'s CMake build finds the install;
#   pkg_config        consumer/main.cc compiled by one compiler command with the flags of
#                     `pkg-config --cflags --libs grace` for the install.
# Also given: GRACE_SOURCE_DIR, WORK_DIR, GENERATOR, MAKE_PROGRAM, CXX_COMPILER, CXX_FLAGS,
# PREFIX_PATH (the outer build's CMAKE_PREFIX_PATH), PKG_CONFIG.
cmake_minimum_required(VERSION 3.25)

function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE status OUTPUT_VARIABLE out
                  ERROR_VARIABLE out)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "${what} failed (${status}):\n${out}")
  endif()
  message(STATUS "${what}: ok")
endfunction()

# What `pkg-config <ARGN> grace` says of the install under PREFIX, as a list of arguments.
function(grace_pc_flags out)
  execute_process(COMMAND ${PKG_CONFIG} ${ARGN} grace RESULT_VARIABLE status
                  OUTPUT_VARIABLE flags ERROR_VARIABLE flags OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "pkg-config ${ARGN} grace failed:\n${flags}")
  endif()
  separate_arguments(flags UNIX_COMMAND "${flags}")
  set(${out} ${flags} PARENT_SCOPE)
endfunction()

function(require_inside path dir what)
  cmake_path(ABSOLUTE_PATH path NORMALIZE)
  cmake_path(ABSOLUTE_PATH dir NORMALIZE)
  cmake_path(IS_PREFIX dir "${path}" NORMALIZE inside)
  if(NOT inside)
    message(FATAL_ERROR "${what} is ${path}, not under ${dir}")
  endif()
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
# The install first on pkg-config's path, as a user who installed grace there would put it;
# liburcu and abseil come from the rest of the path.
set(ENV{PKG_CONFIG_PATH} "${PREFIX}/${LIBDIR}/pkgconfig:$ENV{PKG_CONFIG_PATH}")
set(build_args -G ${GENERATOR} -DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}
               -DCMAKE_CXX_COMPILER=${CXX_COMPILER} "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}")
# The compiler as the builds without CMake below call it (pkg-config carries no standard).
separate_arguments(cxx_flags UNIX_COMMAND "${CXX_FLAGS}")
set(compile ${CXX_COMPILER} ${cxx_flags} -std=c++20)

if(MODE STREQUAL "install")
  file(REMOVE_RECURSE ${PREFIX})
  run_step("configure grace's libraries"
           ${CMAKE_COMMAND} -S ${GRACE_SOURCE_DIR} -B ${WORK_DIR}/grace ${build_args}
                            -DCMAKE_BUILD_TYPE=Release "-DCMAKE_PREFIX_PATH=${PREFIX_PATH}"
                            -DCMAKE_INSTALL_LIBDIR=${LIBDIR} -DGRACE_BUILD_TESTS=OFF
                            -DGRACE_BUILD_BENCH=OFF -DGRACE_BUILD_EXAMPLES=OFF)
  run_step("build grace's libraries" ${CMAKE_COMMAND} --build ${WORK_DIR}/grace -j 2)
  run_step("install grace to ${PREFIX}"
           ${CMAKE_COMMAND} --install ${WORK_DIR}/grace --prefix ${PREFIX})
  foreach(expected include/grace/map/hash_map.h include/grace/alloc/object_pool.h
                   include/grace/reclaim/domain.h include/grace/map/detail/split_list.h
                   ${LIBDIR}/libgrace_map.a ${LIBDIR}/libgrace_alloc.a
                   ${LIBDIR}/libgrace_reclaim.a ${LIBDIR}/cmake/grace/graceConfig.cmake
                   ${LIBDIR}/cmake/grace/graceConfigVersion.cmake
                   ${LIBDIR}/cmake/grace/graceTargets.cmake ${LIBDIR}/pkgconfig/grace.pc
                   share/doc/grace/LICENSE)
    if(NOT EXISTS ${PREFIX}/${expected})
      message(FATAL_ERROR "the install lacks ${expected}")
    endif()
  endforeach()
  file(GLOB_RECURSE internal_headers RELATIVE ${PREFIX} ${PREFIX}/*_internal.h)
  if(internal_headers)
    message(FATAL_ERROR "the install holds private headers: ${internal_headers}")
  endif()
  # Every installed header compiles on its own: none relies on another included before it.
  grace_pc_flags(cflags --cflags)
  file(GLOB_RECURSE headers RELATIVE ${PREFIX}/include ${PREFIX}/include/grace/*.h)
  foreach(header ${headers})
    string(MAKE_C_IDENTIFIER ${header} unit)
    file(WRITE ${WORK_DIR}/headers/${unit}.cc "#include <${header}>\n")
    run_step("${header} on its own"
             ${compile} -fsyntax-only ${cflags} ${WORK_DIR}/headers/${unit}.cc)
  endforeach()
  return()
endif()

if(MODE STREQUAL "pkg_config")
  foreach(variable libdir includedir)
    grace_pc_flags(value --variable=${variable})
    require_inside("${value}" ${PREFIX} "grace.pc's ${variable}")
  endforeach()
  grace_pc_flags(flags --cflags --libs)
  file(MAKE_DIRECTORY ${WORK_DIR})
  run_step("compile and link the consumer with pkg-config's flags"
           ${compile} ${CMAKE_CURRENT_LIST_DIR}/consumer/main.cc ${flags} -o ${WORK_DIR}/consumer)
  run_step("run the consumer" ${WORK_DIR}/consumer)
  return()
endif()

if(MODE STREQUAL "add_subdirectory")
  set(consumer_args -DGRACE_SOURCE_DIR=${GRACE_SOURCE_DIR} "-DCMAKE_PREFIX_PATH=${PREFIX_PATH}")
elseif(MODE STREQUAL "find_package")
  set(consumer_args "-DCMAKE_PREFIX_PATH=${PREFIX};${PREFIX_PATH}"
                    -DGRACE_EXPECTED_PREFIX=${PREFIX})
else()
  message(FATAL_ERROR "MODE must be install, add_subdirectory, find_package or pkg_config, "
                      "not '${MODE}'")
endif()
run_step("configure the consumer"
         ${CMAKE_COMMAND} -S ${CMAKE_CURRENT_LIST_DIR}/consumer -B ${WORK_DIR} ${build_args}
                          -DCMAKE_BUILD_TYPE=Debug -DGRACE_CONSUME=${MODE} ${consumer_args})
run_step("build the consumer" ${CMAKE_COMMAND} --build ${WORK_DIR} -j 2)
run_step("run the consumer" ${WORK_DIR}/consumer)
