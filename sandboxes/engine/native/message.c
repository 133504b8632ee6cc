/*
 * Receiving one SEQPACKET message with the descriptors passed along with it:
 * the zygote reads the spawner's requests this way, and init its exec
 * requests.  Both treat the peer's message as untrusted input.
 */
#define _GNU_SOURCE
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "forkyard.h"

ssize_t receive_message(int socket, char *buffer, size_t size, int flags, struct received *fds) {
    struct iovec vector = {buffer, size};
    union {
        char buffer[CMSG_SPACE(sizeof(int) * MAX_RECEIVED_FDS)];
        struct cmsghdr align;
    } control;
    struct msghdr header = {0};
    header.msg_iov = &vector;
    header.msg_iovlen = 1;
    header.msg_control = control.buffer;
    header.msg_controllen = sizeof control.buffer;
    fds->count = 0;
    fds->truncated = 0;
    ssize_t length = recvmsg(socket, &header, flags | MSG_CMSG_CLOEXEC);
    if (length < 0) return length;
    /* Descriptors that did not fit were closed by the kernel (MSG_CTRUNC). */
    fds->truncated = (header.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0;
    for (struct cmsghdr *cmsg = CMSG_FIRSTHDR(&header); cmsg; cmsg = CMSG_NXTHDR(&header, cmsg)) {
        if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS || cmsg->cmsg_len < CMSG_LEN(0))
            continue;
        size_t count = (cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        int received[MAX_RECEIVED_FDS];
        if (count > MAX_RECEIVED_FDS) count = MAX_RECEIVED_FDS;
        memcpy(received, CMSG_DATA(cmsg), count * sizeof(int));
        for (size_t index = 0; index < count; index++) {
            if (fds->count < MAX_RECEIVED_FDS) fds->fds[fds->count++] = received[index];
            else close(received[index]), fds->truncated = 1;
        }
    }
    return length;
}

void close_received(struct received *fds) {
    for (int index = 0; index < fds->count; index++) close(fds->fds[index]);
    fds->count = 0;
}
