/*
 * Preloaded before libfaketime by the chaos campaign (benchmarks/chaos.py, ``clock_env``).
 *
 * libfaketime 0.9.10 (Debian's) with FAKETIME_DONT_FAKE_MONOTONIC=1 moves the deadline of
 * clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, ...) by the wall clock's offset and hands the
 * kernel a negative time: Python 3.11's time.sleep() then fails with "OSError: [Errno 22]
 * Invalid argument" (wolfcw/libfaketime#426, fixed after 0.9.10). A sleep on any clock but the
 * wall clock goes straight to the kernel here; one on the wall clock goes on to libfaketime.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

int clock_nanosleep(clockid_t clock_id, int flags, const struct timespec *request, struct timespec *remain)
{
    static int (*next)(clockid_t, int, const struct timespec *, struct timespec *);

    if (clock_id != CLOCK_REALTIME && clock_id != CLOCK_REALTIME_ALARM && clock_id != CLOCK_TAI) {
        long done = syscall(SYS_clock_nanosleep, clock_id, flags, request, remain);
        return done == -1 ? errno : 0;
    }
    if (!next)
        next = (int (*)(clockid_t, int, const struct timespec *, struct timespec *))dlsym(RTLD_NEXT, "clock_nanosleep");
    return next(clock_id, flags, request, remain);
}
