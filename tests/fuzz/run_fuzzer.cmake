# One fuzz target's CTest run (see CMakeLists.txt here):
#   cmake -DFUZZER=<binary> -DSEEDS=<seed corpus> -DWORK=<scratch dir> -DSECONDS=<n> -P run_fuzzer.cmake
# Copies the seeds into WORK/corpus (libFuzzer adds new inputs there), fuzzes for SECONDS
# and fails on a crash, a leak, or an input slower than 25 s (a hang); the crashing input is
# WORK/crash-<sha1> (or timeout-, leak-), replayable with `<binary> <that file>`.
foreach(var FUZZER SEEDS WORK SECONDS)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_fuzzer.cmake: -D${var}=... missing")
  endif()
endforeach()
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}/corpus")
file(GLOB seeds "${SEEDS}/*")
if(seeds)
  file(COPY ${seeds} DESTINATION "${WORK}/corpus")
endif()
execute_process(COMMAND "${FUZZER}" -max_total_time=${SECONDS} -timeout=25
                        -print_final_stats=1 -artifact_prefix=${WORK}/ "${WORK}/corpus"
                RESULT_VARIABLE result)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "${FUZZER} failed (${result}); the input that failed is in ${WORK}")
endif()
