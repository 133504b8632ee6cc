/*
 * What the native program's three parts share: the zygote (zygote.c) clones
 * every sandbox, its child confines itself (confine.c) and then becomes the
 * sandbox's PID 1 and exec agent (init.c), all without an exec.
 */
#ifndef FORKYARD_H
#define FORKYARD_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <unistd.h>

/* The zygote's end of its socket to the spawner. */
enum { FD_SPAWNER = 3 };
/* What init finds open when it starts serving (see init.c). */
enum { FD_LISTEN = 3, FD_READY = 4, FD_LAYER = 5 };

enum {
    MAX_MESSAGE = 64 * 1024, /* one request from the spawner */
    MAX_CGROUPS = 16,
    MAX_LAYERS = 128, /* lower layers of one sandbox (snapshots flatten well before) */
    MAX_STEPS = 128,
    MAX_FILTER = 4096, /* BPF_MAXINSNS */
    MAX_FIELD = 4096,  /* longest string field (a path) */
};

enum step_op {
    OP_MOUNT,          /* mount source (or fstype) on target */
    OP_BIND_REMOUNT,   /* bind a host directory (or the target itself) onto the target, then remount it with flags */
    OP_MKDIR,          /* make the target directory if it is absent */
    OP_KEEP_LAYER,     /* keep an O_PATH handle on the target: init's fd 5 */
    OP_CHDIR,          /* change directory (overlay lowerdirs are relative) */
    OP_ENTER_ROOT,     /* the target is the new root: relative targets live under it */
    OP_PIVOT,          /* pivot_root into the new root and detach the old one */
    OP_ATTACH_LAYERS,  /* make the target directory and mount each layer on <target>/<n>, n = 0, 1, ... */
    OP_HOSTS,          /* make the target directory holding etc/hosts: data, the hostname, then source */
};

enum missing_policy { MISSING_FAIL, MISSING_SKIP, MISSING_CREATE };

/* One step of the root filesystem plan that rootfs.py builds.  An absolute
 * target is a host path (steps before the new root exists); a relative one
 * lives under the new root, on the mount named by `within` ("" for the root
 * itself). */
struct step {
    enum step_op op;
    const char *within;
    const char *target;
    const char *source; /* NULL when empty */
    const char *fstype; /* NULL when empty: a bind */
    const char *data;   /* NULL when empty */
    unsigned long flags;
    mode_t mode;
    enum missing_policy missing;
};

/* The same for every sandbox: sent once by the spawner at start. */
struct confinement {
    uint64_t kept_capabilities; /* bit n: keep capability n */
    uint16_t filter_length;     /* seccomp program, in instructions */
    unsigned char filter[MAX_FILTER * 8];
};

/* One sandbox.  Strings point into the zygote's message buffer, which the
 * child keeps (copy-on-write) until it has built its root. */
struct spawn_request {
    const char *token;
    const char *hostname;
    const char *resolv;           /* the sandbox's /etc/resolv.conf, beside its /etc/hosts; "": none */
    uint32_t uid_base, uid_count; /* root inside is uid_base outside: the sandbox's own range */
    uint32_t layers_uid;          /* the range that owns the layers on disk (the sandboxes' group too) */
    uint64_t nofile;
    size_t cgroup_count;
    const char *cgroup_procs[MAX_CGROUPS];
    size_t layer_count;
    const char *layers[MAX_LAYERS]; /* host paths, topmost first */
    size_t step_count;
    struct step steps[MAX_STEPS];
    int listen_fd, ready_fd;
    /* Detached mounts of the layers, shifted from layers_uid to uid_base
     * (made by the zygote, which alone may; moved into place by the child). */
    int layer_fds[MAX_LAYERS];
};

/* confine.c: runs in the cloned child; never returns.  Once confined, the
 * child no longer needs the zygote's buffers (the request and confinement
 * among them): ``release_buffers`` gives their pages back.  A callback, so
 * the confinement steps need know nothing of how the zygote keeps them. */
__attribute__((noreturn)) void confine_and_serve(const struct spawn_request *request,
                                                 const struct confinement *confinement, int sync_fd,
                                                 void (*release_buffers)(void));

/* message.c: one message and the descriptors that came with it. */
enum { MAX_RECEIVED_FDS = 4 };
struct received {
    int fds[MAX_RECEIVED_FDS];
    int count;
    int truncated; /* the message or its descriptors did not fit */
};
ssize_t receive_message(int socket, char *buffer, size_t size, int flags, struct received *fds);
void close_received(struct received *fds);

/* init.c: serve exec requests on FD_LISTEN until killed. */
int init_serve(void);

/* files.c: a child of init that makes the file API's changes in the sandbox,
 * serving one connection from the engine, then exiting. */
__attribute__((noreturn)) void files_serve(int connection);

#endif
