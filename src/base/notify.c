#include "base/notify.h"

#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

fitm_status fitm_notify_send(const char *state, fitm_err *err)
{
    const char *path = getenv("NOTIFY_SOCKET");
    if (!path || !path[0])
        return FITM_OK;
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    size_t n = strlen(path);
    if ((path[0] != '/' && path[0] != '@') || n >= sizeof sa.sun_path)
        return fitm_err_set(err, FITM_ERR_IO, "NOTIFY_SOCKET '%s' is not a socket path", path);
    memcpy(sa.sun_path, path, n);
    if (path[0] == '@')
        sa.sun_path[0] = '\0'; /* abstract namespace: the length below counts every byte */
    socklen_t len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n);
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return fitm_err_set(err, FITM_ERR_IO, "notify socket: %s", strerror(errno));
    ssize_t sent = sendto(fd, state, strlen(state), MSG_NOSIGNAL, (struct sockaddr *)&sa, len);
    int e = errno;
    close(fd);
    if (sent < 0)
        return fitm_err_set(err, FITM_ERR_IO, "notify %s: %s", path, strerror(e));
    return FITM_OK;
}

int64_t fitm_notify_watchdog_usec(void)
{
    const char *usec = getenv("WATCHDOG_USEC");
    if (!usec || !usec[0])
        return 0;
    const char *pid = getenv("WATCHDOG_PID");
    if (pid && pid[0] && strtoll(pid, NULL, 10) != (long long)getpid())
        return 0; /* meant for another process (e.g. a wrapper that exec'd us is gone) */
    char *end;
    errno = 0;
    long long v = strtoll(usec, &end, 10);
    return errno || *end || v <= 0 ? 0 : (int64_t)v;
}
