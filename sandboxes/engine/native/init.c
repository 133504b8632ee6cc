/*
 * forkyard-init: PID 1 of every sandbox, and the agent that runs its execs.
 *
 * Why C and not Python: this process lives as long as its sandbox, so its
 * memory is paid 32,752 times on a full host.  Built static against musl it
 * holds a few dozen KiB; a Python interpreter would hold ~10 MiB.
 *
 * It is not exec'd: the zygote (zygote.c) clones a child that confines itself
 * (confine.c: namespaces, cgroup, root filesystem, capabilities,
 * no_new_privs, seccomp) and then calls init_serve() with:
 *   fd 3  a listening SOCK_SEQPACKET socket bound at a host path that only the
 *         engine can reach; every exec request arrives on a connection to it.
 *   fd 4  the write end of the "ready" pipe: one byte once we accept requests.
 *   fd 5  (optional) an O_PATH handle on the sandbox's writable layer, kept so
 *         that the engine can read it through /proc/<pid>/fd/5 for snapshots.
 *
 * Protocol, one message per packet (host byte order):
 *   request  'X' u8 flags u8[2] u32 argc u32 envc u32 xflags, then (flags
 *            EXEC_AS_USER) u32 uid u32 gid u32 ngroups u32 groups[ngroups],
 *            then cwd\0 argv[0]\0 ... env[0]\0 ...
 *            (xflags: X_TERMINAL, stdin is a terminal the command takes as its
 *            controlling terminal; unknown bits are ignored)
 *            with SCM_RIGHTS carrying three fds, stdin, stdout, stderr, and
 *            optionally a fourth: the cgroup.procs of the command's own cgroup
 *            (opened by the engine, as host root), which the command joins
 *            before it execs, so that everything it starts can be found (and
 *            killed) there, even what leaves its session with setsid.
 *   request  'K'  kill the running command's process group.
 *   request  'P'  ping; answered 'P' u32 number of running commands.
 *   request  'F'  hand this connection to a new file writer (files.c): a
 *                 child of init, so the files the engine writes are the
 *                 sandbox's own in every count.  Answered 'F' i32 errno only
 *                 if it could not be started; otherwise the writer answers.
 *   reply    'S' i32 pid          the command started (pid inside the sandbox)
 *   reply    'F' i32 errno u8 step  it could not start (step 'c' chdir, 'x' exec,
 *                                  'g' join its cgroup, 't' take its terminal,
 *                                  'u' become its user)
 *   reply    'W' i32 wait status  it ended
 * Closing the connection before 'W' kills the command's process group: an
 * exec never outlives the engine's interest in it.
 *
 * After 'W' the connection is idle again and takes the next 'X': the engine
 * keeps a few such connections per sandbox rather than connect and close for
 * every command (execution.py, InitConnections).  After 'F' (the command
 * could not start) it takes nothing more: the engine closes it.
 *
 * Every byte of a request is validated; a malformed one closes its connection
 * and nothing else.  PID 1 has no signal handlers, so nothing inside the
 * sandbox can kill it; the engine kills it with SIGKILL from outside.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "forkyard.h"

enum { MAX_REQUEST = 256 * 1024, MAX_ARGS = 4096, PATH_BUFFER = 4096 };
/* An exec as a user other than root: the ids (inside the sandbox's user
 * namespace), its groups, set in the command's child before it execs. */
enum { EXEC_AS_USER = 1, MAX_GROUPS = 256, MAX_SANDBOX_ID = 65535 };
enum { CONN_IDLE, CONN_RUNNING, CONN_FAILED };
enum { X_TERMINAL = 1 };

static const char DEFAULT_PATH[] = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

struct connection {
    int fd;
    int state;
    pid_t pid;
};

static struct connection *connections;
static size_t connection_count, connection_capacity;
static char request[MAX_REQUEST + 1];
static char *argv_buffer[MAX_ARGS + 1];
static char *env_buffer[MAX_ARGS + 1];
static struct {
    int set;
    uint32_t uid, gid, count;
    gid_t groups[MAX_GROUPS];
} identity;

/* Written by the vfork child, read by the parent once the child has exec'd or
 * died: vfork shares our memory and suspends us until then. */
static volatile int child_errno;
static volatile char child_step;

static void send_reply(int fd, char kind, int32_t value, char step) {
    char message[9];
    size_t length = 5;
    message[0] = kind;
    memcpy(message + 1, &value, sizeof value);
    if (step) {
        message[5] = step;
        length = 6;
    }
    /* MSG_DONTWAIT: a peer that stopped reading must never block PID 1. */
    (void)send(fd, message, length, MSG_DONTWAIT | MSG_NOSIGNAL);
}

static void make_cloexec(int fd) {
    int flags = fcntl(fd, F_GETFD);
    if (flags >= 0) (void)fcntl(fd, F_SETFD, flags | FD_CLOEXEC);
}

/* Look argv[0] up in PATH from the command's own environment (the engine
 * always sends one), without allocating: we run in a vfork child. */
static void exec_command(char **argv, char **envp) {
    const char *path = DEFAULT_PATH;
    char candidate[PATH_BUFFER];
    int saw_eacces = 0;
    if (strchr(argv[0], '/')) {
        execve(argv[0], argv, envp);
        return;
    }
    for (char **entry = envp; *entry; entry++) {
        if (strncmp(*entry, "PATH=", 5) == 0) path = *entry + 5;
    }
    size_t name_length = strlen(argv[0]);
    while (*path) {
        const char *end = strchr(path, ':');
        size_t dir_length = end ? (size_t)(end - path) : strlen(path);
        if (dir_length == 0) dir_length = 1, path = ".";  /* empty entry means cwd */
        if (dir_length + 1 + name_length + 1 <= sizeof candidate) {
            memcpy(candidate, path, dir_length);
            candidate[dir_length] = '/';
            memcpy(candidate + dir_length + 1, argv[0], name_length + 1);
            execve(candidate, argv, envp);
            if (errno == EACCES) saw_eacces = 1;
            else if (errno != ENOENT && errno != ENOTDIR) return;
        }
        if (!end) break;
        path = end + 1;
    }
    errno = saw_eacces ? EACCES : ENOENT;
}

/* Split "cwd\0argv...\0env...\0" into the static argument vectors. */
static int parse_request(size_t length, uint32_t argc, uint32_t envc, char **cwd) {
    if (argc == 0 || argc > MAX_ARGS || envc > MAX_ARGS) return -1;
    size_t offset = 16;
    identity.set = (request[1] & EXEC_AS_USER) != 0;
    if (request[1] & ~EXEC_AS_USER) return -1;
    if (identity.set) {
        uint32_t fields[3];
        if (length < offset + sizeof fields) return -1;
        memcpy(fields, request + offset, sizeof fields);
        offset += sizeof fields;
        identity.uid = fields[0], identity.gid = fields[1], identity.count = fields[2];
        if (identity.uid > MAX_SANDBOX_ID || identity.gid > MAX_SANDBOX_ID || identity.count > MAX_GROUPS) return -1;
        if (length < offset + identity.count * sizeof(uint32_t)) return -1;
        for (uint32_t index = 0; index < identity.count; index++) {
            uint32_t group;
            memcpy(&group, request + offset, sizeof group);
            offset += sizeof group;
            if (group > MAX_SANDBOX_ID) return -1;
            identity.groups[index] = group;
        }
    }
    size_t wanted = 1 + (size_t)argc + envc;
    char **slots[3] = {cwd, argv_buffer, env_buffer};
    for (size_t index = 0; index < wanted; index++) {
        if (offset >= length) return -1;
        char *start = request + offset;
        char *end = memchr(start, '\0', length - offset);
        if (!end) return -1;
        if (index == 0) *slots[0] = start;
        else if (index <= argc) argv_buffer[index - 1] = start;
        else env_buffer[index - 1 - argc] = start;
        offset = (size_t)(end - request) + 1;
    }
    if (offset != length || (*cwd)[0] != '/') return -1;
    argv_buffer[argc] = NULL;
    env_buffer[envc] = NULL;
    return 0;
}

static void start_command(struct connection *conn, int *fds, char *cwd, uint32_t flags) {
    sigset_t empty;
    sigemptyset(&empty);
    child_errno = 0;
    child_step = 0;
    pid_t pid = vfork();
    if (pid == 0) {
        /* The blocked SIGCHLD would otherwise survive exec. */
        sigprocmask(SIG_SETMASK, &empty, NULL);
        /* Join the command's cgroup first, so that nothing it starts is
         * outside it.  The kernel checks the opener's credentials (the
         * engine's), not ours. */
        if (fds[3] >= 0 && write(fds[3], "0", 1) != 1) {
            child_errno = errno, child_step = 'g';
            _exit(127);
        }
        setsid();
        if (dup2(fds[0], 0) < 0 || dup2(fds[1], 1) < 0 || dup2(fds[2], 2) < 0) {
            child_errno = errno, child_step = 'x';
            _exit(127);
        }
        /* A terminal (a background process's pty): the new session's
         * controlling terminal, so that ^C and job control reach it. */
        if ((flags & X_TERMINAL) && ioctl(0, TIOCSCTTY, 0) < 0) {
            child_errno = errno, child_step = 't';
            _exit(127);
        }
        /* Its user: groups, then gid, then uid (after which it holds no
         * capability: the kernel clears them when every uid leaves 0).  Raw
         * system calls: libc's set*id would signal other threads, and a
         * vfork child must not. */
        if (identity.set && (syscall(SYS_setgroups, (size_t)identity.count, identity.groups) < 0 ||
                             syscall(SYS_setresgid, identity.gid, identity.gid, identity.gid) < 0 ||
                             syscall(SYS_setresuid, identity.uid, identity.uid, identity.uid) < 0)) {
            child_errno = errno, child_step = 'u';
            _exit(127);
        }
        if (chdir(cwd) < 0) {
            child_errno = errno, child_step = 'c';
            _exit(127);
        }
        exec_command(argv_buffer, env_buffer);
        child_errno = errno, child_step = 'x';
        _exit(127);
    }
    if (pid < 0) {
        send_reply(conn->fd, 'F', errno, 'f');
        conn->state = CONN_FAILED;
        return;
    }
    conn->pid = pid;
    if (child_step) {
        /* It already exited: the reaper will see it and stay silent. */
        send_reply(conn->fd, 'F', child_errno, child_step);
        conn->state = CONN_FAILED;
        return;
    }
    conn->state = CONN_RUNNING;
    send_reply(conn->fd, 'S', pid, 0);
}

static void kill_command(struct connection *conn) {
    if (conn->state == CONN_RUNNING && conn->pid > 0) {
        kill(-conn->pid, SIGKILL);
        kill(conn->pid, SIGKILL);
    }
}

/* A file writer for this connection (files.c): a raw clone, like fork (see
 * confine.c on libc in a raw clone's child).  It inherits our cgroups,
 * namespaces, root, credentials and seccomp filter: what it writes is
 * charged to the sandbox, and it can reach only what the sandbox can. */
static void start_files(struct connection *conn) {
    long pid = syscall(SYS_clone, SIGCHLD, 0, 0, 0, 0);
    if (pid == 0) {
        sigset_t empty;
        sigemptyset(&empty);
        sigprocmask(SIG_SETMASK, &empty, NULL);
        /* The connection becomes fd 3; every other fd of ours is closed. */
        if (dup2(conn->fd, FD_LISTEN) < 0 || syscall(SYS_close_range, FD_LISTEN + 1, ~0U, 0) < 0) _exit(1);
        files_serve(FD_LISTEN);
    }
    if (pid < 0) send_reply(conn->fd, 'F', errno, 0);
}

static void drop_connection(size_t index) {
    kill_command(&connections[index]);
    close(connections[index].fd);
    connections[index] = connections[--connection_count];
}

/* Returns 0 to keep the connection, -1 to drop it. */
static int handle_message(struct connection *conn) {
    struct received received;
    ssize_t length = receive_message(conn->fd, request, MAX_REQUEST, MSG_DONTWAIT, &received);
    if (length < 0) return (errno == EAGAIN || errno == EINTR) ? 0 : -1;
    if (length == 0) return -1;
    int *fds = received.fds, fd_count = received.count;
    int result = -1;
    char op = request[0];
    if (received.truncated) {
        result = -1;
    } else if (op == 'X' && conn->state == CONN_IDLE && (fd_count == 3 || fd_count == 4) && length >= 16) {
        uint32_t argc, envc, flags;
        char *cwd = NULL;
        int command_fds[4] = {fds[0], fds[1], fds[2], fd_count == 4 ? fds[3] : -1};
        memcpy(&argc, request + 4, sizeof argc);
        memcpy(&envc, request + 8, sizeof envc);
        memcpy(&flags, request + 12, sizeof flags);
        if (parse_request((size_t)length, argc, envc, &cwd) == 0) {
            start_command(conn, command_fds, cwd, flags);
            result = 0;
        }
    } else if (op == 'F' && conn->state == CONN_IDLE && fd_count == 0 && length == 1) {
        /* The writer has the connection now: we drop our end of it. */
        start_files(conn);
    } else if (op == 'K' && fd_count == 0) {
        kill_command(conn);
        result = 0;
    } else if (op == 'P' && fd_count == 0) {
        int32_t running = 0;
        for (size_t index = 0; index < connection_count; index++)
            running += connections[index].state == CONN_RUNNING;
        send_reply(conn->fd, 'P', running, 0);
        result = 0;
    }
    close_received(&received);
    return result;
}

static void reap_children(void) {
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        for (size_t index = 0; index < connection_count; index++) {
            struct connection *conn = &connections[index];
            if (conn->pid != pid) continue;
            conn->pid = 0;
            if (conn->state == CONN_RUNNING) {
                /* Idle before the engine can read 'W': its next 'X' on this
                 * connection finds it ready. */
                conn->state = CONN_IDLE;
                send_reply(conn->fd, 'W', status, 0);
            } else {
                conn->state = CONN_FAILED;
            }
        }
    }
}

static void accept_connections(void) {
    for (;;) {
        int fd = accept4(FD_LISTEN, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) return;
        if (connection_count == connection_capacity) {
            size_t capacity = connection_capacity ? connection_capacity * 2 : 16;
            struct connection *grown = realloc(connections, capacity * sizeof *grown);
            if (!grown) {
                close(fd);
                return;
            }
            connections = grown;
            connection_capacity = capacity;
        }
        connections[connection_count++] = (struct connection){fd, CONN_IDLE, 0};
    }
}

int init_serve(void) {
    /* Non-dumpable: code in the sandbox holds no CAP_SYS_PTRACE, so it can
     * neither ptrace us nor open our /proc/1/fd (the writable layer, fd 5).
     * confine.c already set it; it costs nothing to say it where it matters. */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    make_cloexec(FD_LISTEN);
    make_cloexec(FD_LAYER);
    umask(022);

    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    int signal_fd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    if (signal_fd < 0) return 111;
    int flags = fcntl(FD_LISTEN, F_GETFL);
    if (flags < 0 || fcntl(FD_LISTEN, F_SETFL, flags | O_NONBLOCK) < 0) return 112;

    if (write(FD_READY, "R", 1) != 1) return 113;
    close(FD_READY);

    struct pollfd *polls = NULL;
    size_t poll_capacity = 0;
    for (;;) {
        size_t wanted = connection_count + 2;
        if (wanted > poll_capacity) {
            struct pollfd *grown = realloc(polls, wanted * 2 * sizeof *grown);
            if (!grown) {
                sleep(1);
                continue;
            }
            polls = grown;
            poll_capacity = wanted * 2;
        }
        polls[0] = (struct pollfd){signal_fd, POLLIN, 0};
        polls[1] = (struct pollfd){FD_LISTEN, POLLIN, 0};
        for (size_t index = 0; index < connection_count; index++)
            polls[index + 2] = (struct pollfd){connections[index].fd, POLLIN, 0};
        size_t polled = connection_count;
        if (poll(polls, polled + 2, -1) < 0) continue;

        if (polls[0].revents) {
            struct signalfd_siginfo info;
            while (read(signal_fd, &info, sizeof info) > 0) {}
            reap_children();
        }
        /* Walk backwards: drop_connection moves the last entry into the gap. */
        for (size_t index = polled; index-- > 0;) {
            short events = polls[index + 2].revents;
            if (!events) continue;
            if ((events & POLLIN) && handle_message(&connections[index]) == 0) continue;
            if (events & (POLLIN | POLLHUP | POLLERR | POLLNVAL)) drop_connection(index);
        }
        if (polls[1].revents) accept_connections();
    }
}
