/* notify: the service manager's readiness protocol (systemd's sd_notify, Type=notify), written
 * here over one unix datagram socket so fitmd needs no libsystemd: READY=1 once the model is
 * loaded, WATCHDOG=1 while the daemon is healthy, STOPPING=1 when it drains. Outside such a
 * manager ($NOTIFY_SOCKET unset) every call does nothing. */
#ifndef FITM_NOTIFY_H
#define FITM_NOTIFY_H

#include <stdint.h>

#include "base/status.h"

/* Sends state (newline-separated VAR=value lines, e.g. "READY=1\nSTATUS=ready") to
 * $NOTIFY_SOCKET: a filesystem path or, with a leading '@', an abstract socket name. FITM_OK
 * when sent or when NOTIFY_SOCKET is unset; FITM_ERR_IO with the reason otherwise (the caller
 * logs it: a lost notification must not stop the daemon). */
fitm_status fitm_notify_send(const char *state, fitm_err *err);

/* The watchdog interval the manager asks for ($WATCHDOG_USEC, for this process when
 * $WATCHDOG_PID is set), in microseconds; 0 when none. Ping at half of it. */
int64_t fitm_notify_watchdog_usec(void);

#endif
