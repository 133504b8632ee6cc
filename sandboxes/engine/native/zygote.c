/*
 * forkyard's zygote: the small process that clones every sandbox.
 *
 * Why it exists: a sandbox used to be cloned from the Python spawner, so
 * every create copied (and its exec then tore down) a ~7 MiB interpreter
 * heap, and the child ran its mount steps in Python.  This process is a
 * static binary of a few dozen KiB: cloning it is cheap, and its child
 * confines itself in C (confine.c) and then simply *is* the sandbox's init
 * (init.c), with no exec at all.
 *
 * The spawner starts it from the same sealed memfd it always held the init
 * binary in, so /proc/<init>/exe of every sandbox is a file that nobody can
 * write, and gives it one end of a SOCK_SEQPACKET socket pair as fd 3.
 * Messages are NUL-terminated text fields (numbers in decimal); zygote.py
 * writes them:
 *
 *   config  kept-capabilities                    + fd: the seccomp program
 *   spawn   token hostname resolv uid-base uid-count layers-uid nofile
 *           cgroup-count cgroup.procs-path...
 *           layer-count layer-path...
 *           step-count (op within target source fstype data flags mode missing)...
 *                                                + fds: listening socket, ready pipe
 * answered by
 *   ok      token pid
 *   error   token pid step errno target
 *
 * Each sandbox has a uid range of its own (uid-base, uid-count: root inside
 * is uid-base outside), so that the kernel's per-user counts (inotify
 * instances, message queue bytes, pipe buffers, user namespaces...) are its
 * own.  The layers on disk belong to one range for all (layers-uid, also the
 * group that may pass through the state directory); each sandbox sees them
 * through idmapped mounts shifted into its own range: mounts, not copies,
 * and no new superblock.
 *
 * Per spawn, in order: open each layer as a detached mount (open_tree),
 * shift it from layers-uid to uid-base (mount_setattr, MOUNT_ATTR_IDMAP,
 * with a user namespace made for the purpose and owned by uid-base); with
 * uid-base as our effective uid (so that the sandbox's user namespace is
 * *owned* by it: the kernel counts a user namespace's objects against its
 * owner too, and with root as every sandbox's owner one sandbox's 128
 * inotify instances starved every other sandbox and host root),
 * clone(CLONE_PARENT | new user, mount, pid, net, ipc, uts namespaces); root
 * again; write the child's pid into each of its cgroup(s); write its uid and
 * gid maps; answer `ok`; release the child (one byte on a socket pair it
 * waits on).  The child moves the layers into its own mount namespace
 * (confine.c).  The child reports
 * its own failures on the ready pipe (confine.c).  CLONE_PARENT makes every
 * sandbox's init a child of the spawner, not of this process: the spawner
 * reaps them and reports their exits exactly as before, and this process
 * never has a child to wait for.
 *
 * Every field is validated before use: a malformed request is answered
 * `error` and changes nothing.  The zygote exits when the spawner closes its
 * end (the spawner died or retired).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "forkyard.h"

#define SECURE_NO_SETUID_FIXUP (1 << 2) /* linux/securebits.h: SECBIT_NO_SETUID_FIXUP */
#define NAMESPACES (CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS)
enum { REPLY_SIZE = 8192 };

/* What we write for every request lives here, not on the stack, and
 * page-aligned: each child's copy of these pages becomes its own as soon as
 * we write the next request, so the child hands them back once it no longer
 * needs them (release_buffers). */
struct reply {
    char buffer[REPLY_SIZE];
    size_t length;
};
/* Whole pages each: the linker fills the rest of an object's last page with
 * other variables, and a page half ours could not be given back. */
#define PAGE_ROUNDED(size) ((((size) + 4095) / 4096) * 4096)
#define OWN_PAGES __attribute__((aligned(4096)))
static char message[PAGE_ROUNDED(MAX_MESSAGE + 1)] OWN_PAGES;
static char failed_target[PAGE_ROUNDED(MAX_FIELD + 64)] OWN_PAGES;
static union {
    struct spawn_request value;
    char pages[PAGE_ROUNDED(sizeof(struct spawn_request))];
} request_pages OWN_PAGES;
static union {
    struct confinement value;
    char pages[PAGE_ROUNDED(sizeof(struct confinement))];
} confinement_pages OWN_PAGES;
static union {
    struct reply value;
    char pages[PAGE_ROUNDED(sizeof(struct reply))];
} answer_pages OWN_PAGES;
static void release_buffers(void);
static struct spawn_request *const request = &request_pages.value;
static struct confinement *const confinement = &confinement_pages.value;
static struct reply *const answer = &answer_pages.value;
static int configured;

struct cursor {
    char *at, *end;
};

/* The next NUL-terminated field, or NULL if there is none or it is longer
 * than max_length. */
static const char *take_string(struct cursor *cursor, size_t max_length) {
    if (cursor->at >= cursor->end) return NULL;
    char *nul = memchr(cursor->at, '\0', (size_t)(cursor->end - cursor->at));
    if (!nul || (size_t)(nul - cursor->at) > max_length) return NULL;
    char *field = cursor->at;
    cursor->at = nul + 1;
    return field;
}

/* A decimal number no larger than max: digits only, no sign, no overflow. */
static int take_number(struct cursor *cursor, uint64_t max, uint64_t *out) {
    const char *field = take_string(cursor, 20);
    if (!field || !*field) return -1;
    uint64_t value = 0;
    for (; *field; field++) {
        if (*field < '0' || *field > '9') return -1;
        uint64_t digit = (uint64_t)(*field - '0');
        if (value > (max - digit) / 10) return -1;
        value = value * 10 + digit;
    }
    *out = value;
    return 0;
}

/* --- replies ------------------------------------------------------------------ */

/* Fields longer than what is left are cut: a reply is always well formed. */
static void reply_field(struct reply *reply, const char *field) {
    size_t room = sizeof reply->buffer - reply->length;
    size_t length = strnlen(field, room > 0 ? room - 1 : 0);
    if (room == 0) return;
    memcpy(reply->buffer + reply->length, field, length);
    reply->buffer[reply->length + length] = '\0';
    reply->length += length + 1;
}

static void reply_number(struct reply *reply, long long value) {
    char digits[24];
    snprintf(digits, sizeof digits, "%lld", value);
    reply_field(reply, digits);
}

/* MSG_NOSIGNAL rather than ignoring SIGPIPE: ignored signals are inherited by
 * every sandbox's init and, through exec, by every command it runs. */
static int send_reply(const struct reply *reply) {
    for (;;) {
        if (send(FD_SPAWNER, reply->buffer, reply->length, MSG_NOSIGNAL) >= 0) return 0;
        if (errno != EINTR) return -1;
    }
}

static int reply_ok(const char *token, pid_t pid) {
    answer->length = 0;
    reply_field(answer, "ok");
    reply_field(answer, token);
    reply_number(answer, pid);
    return send_reply(answer);
}

static int reply_error(const char *token, pid_t pid, const char *step, int error, const char *target) {
    answer->length = 0;
    reply_field(answer, "error");
    reply_field(answer, token);
    reply_number(answer, pid);
    reply_field(answer, step);
    reply_number(answer, error);
    reply_field(answer, target);
    return send_reply(answer);
}

/* --- config --------------------------------------------------------------------- */

static int read_filter(int fd) {
    struct stat info;
    if (fstat(fd, &info) < 0) return -1;
    if (!S_ISREG(info.st_mode) || info.st_size <= 0 || info.st_size % 8 != 0 ||
        info.st_size > (off_t)sizeof confinement->filter) {
        errno = EINVAL;
        return -1;
    }
    size_t done = 0, size = (size_t)info.st_size;
    while (done < size) {
        ssize_t got = pread(fd, confinement->filter + done, size - done, (off_t)done);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) {
            if (got == 0) errno = EIO;
            return -1;
        }
        done += (size_t)got;
    }
    confinement->filter_length = (uint16_t)(size / 8);
    return 0;
}

static int configure(struct cursor *cursor, const int *fds, int fd_count) {
    uint64_t kept;
    if (take_number(cursor, UINT64_MAX, &kept) < 0 || cursor->at != cursor->end || fd_count != 1)
        return reply_error("config", 0, "parse config", EINVAL, "config");
    if (configured) return reply_error("config", 0, "parse config", EBUSY, "config");
    if (read_filter(fds[0]) < 0) return reply_error("config", 0, "read seccomp program", errno, "seccomp.bpf");
    confinement->kept_capabilities = kept;
    configured = 1;
    return reply_ok("config", 0);
}

/* --- spawn ------------------------------------------------------------------------ */

static const char *const OP_NAMES[] = {
    [OP_MOUNT] = "mount",           [OP_BIND_REMOUNT] = "bind-remount",
    [OP_MKDIR] = "mkdir",           [OP_KEEP_LAYER] = "keep-layer",
    [OP_CHDIR] = "chdir",           [OP_ENTER_ROOT] = "enter-root",
    [OP_PIVOT] = "pivot",           [OP_ATTACH_LAYERS] = "attach-layers",
    [OP_HOSTS] = "hosts",
};
static const char *const MISSING_NAMES[] = {
    [MISSING_FAIL] = "fail",
    [MISSING_SKIP] = "skip",
    [MISSING_CREATE] = "create",
};

static int lookup(const char *name, const char *const *names, int count) {
    for (int index = 0; index < count; index++)
        if (strcmp(name, names[index]) == 0) return index;
    return -1;
}

static const char *empty_as_null(const char *field) { return field[0] ? field : NULL; }

/* One step; returns the name of what is wrong with it, or NULL. */
static const char *parse_step(struct cursor *cursor, struct step *step, int *seen_root, int *seen_pivot) {
    const char *op = take_string(cursor, 32), *within = take_string(cursor, MAX_FIELD),
               *target = take_string(cursor, MAX_FIELD), *source = take_string(cursor, MAX_FIELD),
               *fstype = take_string(cursor, 64), *data = take_string(cursor, MAX_FIELD);
    uint64_t flags, mode;
    if (!op || !within || !target || !source || !fstype || !data) return "step field";
    if (take_number(cursor, UINT32_MAX, &flags) < 0) return "step flags";
    if (take_number(cursor, 07777, &mode) < 0) return "step mode";
    const char *missing = take_string(cursor, 16);
    int op_index = lookup(op, OP_NAMES, (int)(sizeof OP_NAMES / sizeof *OP_NAMES));
    int missing_index = missing ? lookup(missing, MISSING_NAMES, 3) : -1;
    if (op_index < 0) return "step op";
    if (missing_index < 0) return "step missing";
    /* mount(2) copies at most one page of options: refuse rather than cut. */
    if (strlen(data) >= 4096) return "step data";
    if (*seen_pivot) return "step after pivot";
    step->op = (enum step_op)op_index;
    step->within = within;
    step->target = target;
    step->source = empty_as_null(source);
    step->fstype = empty_as_null(fstype);
    step->data = empty_as_null(data);
    step->flags = (unsigned long)flags;
    step->mode = (mode_t)mode;
    step->missing = (enum missing_policy)missing_index;

    int absolute = target[0] == '/', relative = target[0] && !absolute;
    if (within[0] == '/' || (within[0] && !relative)) return "step within";
    switch (step->op) {
    case OP_PIVOT:
        if (target[0] || !*seen_root) return "step target";
        *seen_pivot = 1;
        return NULL;
    case OP_KEEP_LAYER:
    case OP_CHDIR:
    case OP_ATTACH_LAYERS:
        return absolute ? NULL : "step target";
    case OP_HOSTS:
        if (!absolute || *seen_root) return "step target"; /* a directory of the scratch, before the overlay */
        return data[0] ? NULL : "step data";
    case OP_ENTER_ROOT:
        if (!absolute) return "step target";
        *seen_root = 1;
        return NULL;
    case OP_BIND_REMOUNT:
        if (!relative) return "step target";
        if (source[0] && source[0] != '/') return "step source"; /* a host path, if any */
        break;
    case OP_MOUNT:
    case OP_MKDIR:
        if (!absolute && !relative) return "step target";
        break;
    }
    /* A relative target lives under the new root: it must be open by then. */
    if (relative && !*seen_root) return "step before enter-root";
    return NULL;
}

/* Fills `request`; returns the name of the first bad field, or NULL. */
static const char *parse_spawn(struct cursor *cursor) {
    uint64_t number;
    memset(request, 0, sizeof *request);
    for (size_t index = 0; index < MAX_LAYERS; index++) request->layer_fds[index] = -1;
    request->token = take_string(cursor, 32);
    if (!request->token || !request->token[0]) return "token";
    for (const char *digit = request->token; *digit; digit++)
        if (*digit < '0' || *digit > '9') return "token";
    request->hostname = take_string(cursor, 64);  /* HOST_NAME_MAX */
    if (!request->hostname || !request->hostname[0]) return "hostname";
    request->resolv = take_string(cursor, 1024);
    if (!request->resolv) return "resolv";
    if (take_number(cursor, UINT32_MAX, &number) < 0) return "uid_base";
    request->uid_base = (uint32_t)number;
    if (take_number(cursor, UINT32_MAX, &number) < 0 || number == 0) return "uid_count";
    request->uid_count = (uint32_t)number;
    /* The map's last id must fit, and (uid_t)-1 is never a valid id. */
    if ((uint64_t)request->uid_base + request->uid_count > UINT32_MAX) return "uid_count";
    if (take_number(cursor, UINT32_MAX, &number) < 0) return "layers_uid";
    request->layers_uid = (uint32_t)number;
    if ((uint64_t)request->layers_uid + request->uid_count > UINT32_MAX) return "layers_uid";
    if (take_number(cursor, 1 << 30, &request->nofile) < 0 || request->nofile == 0) return "nofile";
    if (take_number(cursor, MAX_CGROUPS, &number) < 0) return "cgroup count";
    request->cgroup_count = (size_t)number;
    for (size_t index = 0; index < request->cgroup_count; index++) {
        const char *path = take_string(cursor, MAX_FIELD);
        if (!path || path[0] != '/') return "cgroup path";
        request->cgroup_procs[index] = path;
    }
    if (take_number(cursor, MAX_LAYERS, &number) < 0) return "layer count";
    request->layer_count = (size_t)number;
    for (size_t index = 0; index < request->layer_count; index++) {
        const char *path = take_string(cursor, MAX_FIELD);
        if (!path || path[0] != '/') return "layer path";
        request->layers[index] = path;
    }
    if (take_number(cursor, MAX_STEPS, &number) < 0) return "step count";
    request->step_count = (size_t)number;
    int seen_root = 0, seen_pivot = 0;
    for (size_t index = 0; index < request->step_count; index++) {
        const char *bad = parse_step(cursor, &request->steps[index], &seen_root, &seen_pivot);
        if (bad) return bad;
    }
    /* The plan must end in the new root: a sandbox never keeps the host's tree. */
    if (!seen_pivot) return "plan without pivot";
    if (cursor->at != cursor->end) return "trailing fields";
    return NULL;
}

static int write_all(const char *path, const char *text) {
    /* openat, not open: musl's open follows O_CLOEXEC with an fcntl for
     * kernels older than 2.6.23, a system call per file for nothing. */
    int fd = openat(AT_FDCWD, path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    size_t length = strlen(text);
    ssize_t written;
    do written = write(fd, text, length);
    while (written < 0 && errno == EINTR);
    int saved = errno;
    close(fd);
    if (written == (ssize_t)length) return 0;
    errno = written < 0 ? saved : EIO;
    return -1;
}

/* Place the child and map its ids; returns 0, or -1 with the failing step's
 * name and target set. */
static int prepare_child(pid_t pid, const char **step, char *target, size_t target_size) {
    char text[64];
    snprintf(text, sizeof text, "%d", (int)pid);
    for (size_t index = 0; index < request->cgroup_count; index++) {
        if (write_all(request->cgroup_procs[index], text) < 0) {
            *step = "place in cgroup";
            snprintf(target, target_size, "%s", request->cgroup_procs[index]);
            return -1;
        }
    }
    /* Root inside is uid_base outside.  setgroups stays allowed: the map is
     * written by a privileged parent, and the child needs setgroups([]). */
    snprintf(text, sizeof text, "0 %u %u\n", request->uid_base, request->uid_count);
    static const char *const maps[] = {"uid_map", "gid_map"};
    for (int index = 0; index < 2; index++) {
        snprintf(target, target_size, "/proc/%d/%s", (int)pid, maps[index]);
        if (write_all(target, text) < 0) {
            *step = "map ids";
            return -1;
        }
    }
    return 0;
}

static int is_type(int fd, mode_t type) {
    struct stat info;
    return fstat(fd, &info) == 0 && (info.st_mode & S_IFMT) == type;
}

/* Our effective ids, as the kernel uses them for what we create (a user
 * namespace's owner is its creator's effective uid); real and saved stay 0,
 * and SECBIT_NO_SETUID_FIXUP (set in main) keeps our capabilities. */
static int act_as(uint32_t id) {
    if (syscall(SYS_setresgid, -1, id, -1) < 0) return -1;
    return (int)syscall(SYS_setresuid, -1, id, -1);
}

static void act_as_root(void) {
    /* Cannot fail: our saved uid and gid are 0, and we hold CAP_SETUID/SETGID. */
    (void)syscall(SYS_setresuid, -1, 0, -1);
    (void)syscall(SYS_setresgid, -1, 0, -1);
}

/* A user namespace that exists only as an id mapping for idmapped mounts:
 * ids inside..inside+count-1 are outside..outside+count-1.  It needs a
 * process while its maps are written: a child that waits, then exits (it is
 * reaped at the next spawn: waiting for it here would make every create
 * wait for it to be scheduled). */
static int make_id_mapping(uint32_t inside, uint32_t outside, uint32_t count, const char **step) {
    int wait_end[2];
    *step = "make layer id mapping";
    if (pipe2(wait_end, O_CLOEXEC) < 0) return -1;
    long pid = syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0);
    if (pid == 0) {
        char byte;
        close(wait_end[1]);
        (void)!read(wait_end[0], &byte, 1);
        _exit(0);
    }
    int saved = errno, fd = -1;
    close(wait_end[0]);
    if (pid > 0) {
        char path[64], text[64];
        snprintf(text, sizeof text, "%u %u %u\n", inside, outside, count);
        static const char *const maps[] = {"uid_map", "gid_map"};
        int index = 0;
        for (; index < 2; index++) {
            snprintf(path, sizeof path, "/proc/%d/%s", (int)pid, maps[index]);
            if (write_all(path, text) < 0) break;
        }
        if (index == 2) {
            snprintf(path, sizeof path, "/proc/%d/ns/user", (int)pid);
            fd = openat(AT_FDCWD, path, O_RDONLY | O_CLOEXEC);
        }
        saved = errno;
    }
    close(wait_end[1]); /* the child reads EOF and exits: reaped later (reap_helpers), not waited for */
    errno = saved;
    return fd;
}

/* Our own children are only these helpers (a sandbox's child is the
 * spawner's, CLONE_PARENT): collect those that have exited. */
static void reap_helpers(void) {
    while (waitpid(-1, NULL, WNOHANG) > 0) {}
}

/* open_tree(2), mount_setattr(2): musl has no wrappers. */
struct mount_attributes {
    uint64_t set, clear, propagation, userns_fd;
};
#define OPEN_TREE_CLONE_FLAG 1
#define MOUNT_ATTR_IDMAP_FLAG 0x00100000

static void close_layers(void) {
    for (size_t index = 0; index < request->layer_count; index++) {
        if (request->layer_fds[index] >= 0) close(request->layer_fds[index]);
        request->layer_fds[index] = -1;
    }
}

/* Each layer as a detached mount, shifted from layers_uid to uid_base (the
 * child moves them into its mount namespace).  Runs as uid_base: the id
 * mapping's user namespace is then the sandbox's, in the kernel's counts. */
static int open_layers(const char **step, char *target, size_t target_size) {
    int mapping = -1;
    if (request->layers_uid != request->uid_base) {
        mapping = make_id_mapping(request->layers_uid, request->uid_base, request->uid_count, step);
        if (mapping < 0) {
            snprintf(target, target_size, "%u", request->uid_base);
            return -1;
        }
    }
    int failed = 0;
    for (size_t index = 0; index < request->layer_count && !failed; index++) {
        snprintf(target, target_size, "%s", request->layers[index]);
        *step = "open layer";
        int tree = (int)syscall(SYS_open_tree, AT_FDCWD, request->layers[index], OPEN_TREE_CLONE_FLAG | O_CLOEXEC);
        if (tree < 0) {
            failed = 1;
            break;
        }
        request->layer_fds[index] = tree;
        if (mapping < 0) continue;
        *step = "shift layer ids (idmapped mount)";
        struct mount_attributes attributes = {MOUNT_ATTR_IDMAP_FLAG, 0, 0, (uint64_t)mapping};
        failed = syscall(SYS_mount_setattr, tree, "", AT_EMPTY_PATH, &attributes, sizeof attributes) < 0;
    }
    int saved = errno;
    if (mapping >= 0) close(mapping); /* the mounts hold it now */
    if (failed) {
        close_layers(); /* nothing of this spawn stays */
        errno = saved;
        return -1;
    }
    return 0;
}

/* The group that may pass through the state directory (statedir.py): our
 * supplementary group, which the child keeps until its root is built. */
static int join_layers_group(uint32_t group) {
    static uint32_t joined = UINT32_MAX;
    if (joined == group) return 0;
    gid_t groups[1] = {group};
    if (syscall(SYS_setgroups, 1, groups) < 0) return -1;
    joined = group;
    return 0;
}

/* Returns -1 only when the spawner is gone (we then exit). */
static int spawn(struct cursor *cursor, const int *fds, int fd_count) {
    const char *bad = parse_spawn(cursor);
    if (!bad && !configured) bad = "not configured";
    const char *token = request->token && request->token[0] ? request->token : "0";
    if (!bad && (fd_count != 2 || !is_type(fds[0], S_IFSOCK) || !is_type(fds[1], S_IFIFO)))
        bad = "file descriptors";
    if (bad) return reply_error(token, 0, "parse request", EINVAL, bad);
    request->listen_fd = fds[0];
    request->ready_fd = fds[1];
    reap_helpers();
    if (join_layers_group(request->layers_uid) < 0)
        return reply_error(token, 0, "join the layers' group", errno, request->hostname);

    /* The child waits on this until it sits in its cgroups and has its id
     * maps: before that it is nobody in its user namespace, and what it
     * creates would be charged to our cgroup.  A socket pair rather than a
     * pipe: if the child was killed meanwhile, our send gets EPIPE
     * (MSG_NOSIGNAL) where a write to a pipe would SIGPIPE us. */
    int sync[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sync) < 0)
        return reply_error(token, 0, "make sync socket", errno, request->hostname);
    const char *step = NULL;
    int result;
    /* As the sandbox's own root: what we create from here to the clone (the
     * id mapping, the sandbox's user namespace) is owned by its range. */
    if (act_as(request->uid_base) < 0) {
        result = errno;
        act_as_root();
        close(sync[0]);
        close(sync[1]);
        return reply_error(token, 0, "act as the sandbox's root", result, request->hostname);
    }
    if (open_layers(&step, failed_target, sizeof failed_target) < 0) {
        result = errno;
        act_as_root();
        close(sync[0]);
        close(sync[1]);
        return reply_error(token, 0, step, result, failed_target);
    }
    /* A raw clone, like fork: the child is at once PID 1 of its new pid
     * namespace, no second fork.  CLONE_PARENT gives it our parent (the
     * spawner); its exit signal is then ours, SIGCHLD. */
    long pid = syscall(SYS_clone, CLONE_PARENT | NAMESPACES | SIGCHLD, 0, 0, 0, 0);
    if (pid == 0) {
        close(sync[1]);
        confine_and_serve(request, confinement, sync[0], release_buffers);
    }
    int clone_errno = errno;
    act_as_root();
    close_layers(); /* the child has its own */
    close(sync[0]);
    if (pid < 0) {
        close(sync[1]);
        return reply_error(token, 0, "clone", clone_errno, request->hostname);
    }
    if (prepare_child((pid_t)pid, &step, failed_target, sizeof failed_target) < 0) {
        /* Closing the socket unreleased makes the child exit; the spawner reaps it. */
        result = reply_error(token, (pid_t)pid, step, errno, failed_target);
        close(sync[1]);
        return result;
    }
    /* Answer before releasing: the spawner then always knows the pid before
     * the child can exit of its own accord. */
    result = reply_ok(token, (pid_t)pid);
    if (result == 0) {
        ssize_t written;
        do written = send(sync[1], "1", 1, MSG_NOSIGNAL);
        while (written < 0 && errno == EINTR);
    }
    close(sync[1]);
    return result;
}

/* Drop the whole pages of [start, start + size) from this process. */
static void release(void *start, size_t size) {
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t first = ((uintptr_t)start + page - 1) & ~(page - 1);
    uintptr_t end = ((uintptr_t)start + size) & ~(page - 1);
    if (end > first) (void)madvise((void *)first, end - first, MADV_DONTNEED);
}

/* In a child: give back the pages of our request buffers (unusable after). */
static void release_buffers(void) {
    release(message, sizeof message);
    release(&request_pages, sizeof request_pages);
    release(&confinement_pages, sizeof confinement_pages);
    release(&answer_pages, sizeof answer_pages);
    release(failed_target, sizeof failed_target);
}

/* --- main ----------------------------------------------------------------------------- */

/* Ignored signals and the signal mask survive exec and fork, so whatever our
 * starter left would pass to every init and every command it runs (Python
 * ignores SIGPIPE and SIGXFSZ, glibc's posix_spawn its internal signals 32
 * and 33).  Raw system calls: musl refuses to touch its own internal signals. */
static int reset_signals(void) {
    struct {
        void *handler;
        unsigned long flags;
        void *restorer;
        uint64_t mask;
    } action = {0, 0, 0, 0}; /* SIG_DFL */
    for (int number = 1; number <= 64; number++) {
        if (number != SIGKILL && number != SIGSTOP && syscall(SYS_rt_sigaction, number, &action, NULL, 8) < 0) return -1;
    }
    uint64_t none = 0;
    return (int)syscall(SYS_rt_sigprocmask, SIG_SETMASK, &none, NULL, 8);
}

int main(void) {
    int type = 0;
    socklen_t type_size = sizeof type;
    if (getsockopt(FD_SPAWNER, SOL_SOCKET, SO_TYPE, &type, &type_size) < 0 || type != SOCK_SEQPACKET) {
        static const char usage[] = "forkyard-init: started by the engine's spawner only (fd 3: its socket)\n";
        (void)!write(2, usage, sizeof usage - 1);
        return 2;
    }
    /* Exit codes for the spawner's log: what could not be set up. */
    if (prctl(PR_SET_NAME, "forkyard-zygote", 0, 0, 0) < 0) return 3;
    /* Changing our effective uid to a sandbox's (see spawn) must not cost us
     * our capabilities.  The sandbox's child clears the bit (confine.c). */
    if (prctl(PR_SET_SECUREBITS, SECURE_NO_SETUID_FIXUP, 0, 0, 0) < 0) return 7;
    if (reset_signals() < 0) return 4;
    /* Whatever else we inherited would reach every sandbox. */
    if (syscall(SYS_close_range, FD_SPAWNER + 1, ~0U, 0) < 0) return 5;
    if (fcntl(FD_SPAWNER, F_SETFD, FD_CLOEXEC) < 0) return 6;

    for (;;) {
        struct received fds;
        ssize_t length;
        do length = receive_message(FD_SPAWNER, message, MAX_MESSAGE, 0, &fds);
        while (length < 0 && errno == EINTR);
        if (length <= 0) return length == 0 ? 0 : 1; /* the spawner is gone */
        message[length] = '\0';
        struct cursor cursor = {message, message + length};
        const char *op = take_string(&cursor, 16);
        int result;
        if (fds.truncated || !op)
            result = reply_error("0", 0, "parse request", fds.truncated ? EMSGSIZE : EINVAL, "message");
        else if (strcmp(op, "config") == 0)
            result = configure(&cursor, fds.fds, fds.count);
        else if (strcmp(op, "spawn") == 0)
            result = spawn(&cursor, fds.fds, fds.count);
        else
            result = reply_error("0", 0, "parse request", EINVAL, op);
        /* The child has its own copies of a spawn's descriptors; ours must go,
         * or the ready pipe would never report the child's death. */
        close_received(&fds);
        if (result < 0) return 1;
    }
}
