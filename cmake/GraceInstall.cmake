# `cmake --install`: the static libraries, the public headers and a CMake package, so that
#   find_package(grace 0.1 REQUIRED)
#   target_link_libraries(my_service PRIVATE grace::grace)
# works against an installed prefix as add_subdirectory() does against the source tree; and a
# pkg-config file for builds without CMake. Included from the top-level CMakeLists.txt when
# GRACE_INSTALL is ON.
include(CMakePackageConfigHelpers)
include(GNUInstallDirs)

set(GRACE_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/grace)

# The headers are the libraries' file sets (grace_cc_library's HDRS: everything under the
# components' include/ folders, detail/ included); the src/*_internal.h headers stay behind.
install(TARGETS grace_reclaim grace_alloc grace_map grace
        EXPORT graceTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        FILE_SET HEADERS DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT graceTargets
        NAMESPACE grace::
        DESTINATION ${GRACE_INSTALL_CMAKEDIR})

configure_package_config_file(cmake/graceConfig.cmake.in
                              ${CMAKE_CURRENT_BINARY_DIR}/graceConfig.cmake
                              INSTALL_DESTINATION ${GRACE_INSTALL_CMAKEDIR})
# 0.x: a new minor version may change the API, so only the same minor version is compatible.
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/graceConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/graceConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/graceConfigVersion.cmake
        DESTINATION ${GRACE_INSTALL_CMAKEDIR})
install(FILES LICENSE DESTINATION ${CMAKE_INSTALL_DOCDIR})

# grace.pc: relocatable where the install directories are relative to the prefix (the
# default): its paths start from the file's own folder, so the file stays right under whatever
# prefix `cmake --install --prefix` is given. Absolute install directories are written as
# they are.
if(IS_ABSOLUTE ${CMAKE_INSTALL_LIBDIR} OR IS_ABSOLUTE ${CMAKE_INSTALL_INCLUDEDIR})
  set(GRACE_PC_LIBDIR ${CMAKE_INSTALL_FULL_LIBDIR})
  set(GRACE_PC_INCLUDEDIR ${CMAKE_INSTALL_FULL_INCLUDEDIR})
else()
  file(RELATIVE_PATH include_from_pc /prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig
       /prefix/${CMAKE_INSTALL_INCLUDEDIR})
  set(GRACE_PC_LIBDIR "\${pcfiledir}/..")
  set(GRACE_PC_INCLUDEDIR "\${pcfiledir}/${include_from_pc}")
endif()
list(TRANSFORM GRACE_PUBLIC_DEFINITIONS PREPEND " -D" OUTPUT_VARIABLE pc_definitions)
string(JOIN "" GRACE_PC_CFLAGS ${pc_definitions})
configure_file(cmake/grace.pc.in ${CMAKE_CURRENT_BINARY_DIR}/grace.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/grace.pc
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
