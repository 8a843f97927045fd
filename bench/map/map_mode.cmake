# `grace-bench map` (bench/map/): its sources and its peer maps, included by
# bench/CMakeLists.txt after the grace-bench target exists. liburcu-cds (cds_lfht), oneTBB
# and libcuckoo are optional: each found one adds its peer and a GRACE_BENCH_HAVE_* definition.
find_package(absl REQUIRED)
pkg_check_modules(URCU_CDS QUIET IMPORTED_TARGET liburcu-cds)
find_package(TBB CONFIG QUIET)
find_package(libcuckoo CONFIG QUIET)

target_sources(grace-bench PRIVATE
  ${CMAKE_CURRENT_LIST_DIR}/map_adapters.h
  ${CMAKE_CURRENT_LIST_DIR}/map_mode.cc
  ${CMAKE_CURRENT_LIST_DIR}/map_value.h)
target_link_libraries(grace-bench PRIVATE absl::flat_hash_map absl::hash absl::synchronization)

set(_grace_bench_map_peers "grace absl_sharded absl_single")
set(_grace_bench_have_cds_lfht 0)
if(TARGET PkgConfig::URCU_CDS)
  set(_grace_bench_have_cds_lfht 1)
  target_link_libraries(grace-bench PRIVATE PkgConfig::URCU_CDS)
  string(APPEND _grace_bench_map_peers " cds_lfht")
endif()
set(_grace_bench_have_tbb 0)
if(TBB_FOUND AND TARGET TBB::tbb AND TARGET TBB::tbbmalloc)
  set(_grace_bench_have_tbb 1)
  # tbbmalloc: concurrent_hash_map's default allocator; the bench asks it to release its
  # caches between measurements (scalable_allocation_command).
  target_link_libraries(grace-bench PRIVATE TBB::tbb TBB::tbbmalloc)
  string(APPEND _grace_bench_map_peers " tbb")
endif()
# grace_bench_libcuckoo: libcuckoo for any benchmark that runs it (grace-bench,
# lookup_floor_bench), from its CMake package or, header-only, a bare header install.
set(_grace_bench_have_libcuckoo 0)
add_library(grace_bench_libcuckoo INTERFACE)
if(libcuckoo_FOUND AND TARGET libcuckoo::libcuckoo)
  set(_grace_bench_have_libcuckoo 1)
  target_link_libraries(grace_bench_libcuckoo INTERFACE libcuckoo::libcuckoo)
elseif(NOT CMAKE_DISABLE_FIND_PACKAGE_libcuckoo)
  find_path(GRACE_LIBCUCKOO_INCLUDE_DIR libcuckoo/cuckoohash_map.hh)
  if(GRACE_LIBCUCKOO_INCLUDE_DIR)
    set(_grace_bench_have_libcuckoo 1)
    target_include_directories(grace_bench_libcuckoo SYSTEM INTERFACE ${GRACE_LIBCUCKOO_INCLUDE_DIR})
  endif()
endif()
if(_grace_bench_have_libcuckoo)
  target_link_libraries(grace-bench PRIVATE grace_bench_libcuckoo)
  string(APPEND _grace_bench_map_peers " libcuckoo")
endif()
set_property(SOURCE ${CMAKE_CURRENT_LIST_DIR}/map_mode.cc APPEND PROPERTY COMPILE_DEFINITIONS
  GRACE_BENCH_HAVE_CDS_LFHT=${_grace_bench_have_cds_lfht}
  GRACE_BENCH_HAVE_TBB=${_grace_bench_have_tbb}
  GRACE_BENCH_HAVE_LIBCUCKOO=${_grace_bench_have_libcuckoo})
message(STATUS "grace-bench map peers: ${_grace_bench_map_peers}")
