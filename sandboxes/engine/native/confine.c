/*
 * The sandbox's side of a create: runs in the zygote's freshly cloned child,
 * which is already PID 1 of new user, mount, pid, net, ipc and uts
 * namespaces, and ends as the sandbox's init (init.c) without an exec.
 *
 * The steps, in the order confine_and_serve() runs them:
 *  1. wait until the zygote has placed us in our cgroup(s) and written our
 *     uid and gid maps;
 *  2. unshare(CLONE_NEWCGROUP), now that we sit in our own cgroup, so that it
 *     is the root of the cgroup tree we see (unsharing first would make the
 *     zygote's cgroup our root, and our own cgroup a path below it);
 *  3. become root of the user namespace; hostname = sandbox id;
 *  4. build the root filesystem by running the plan rootfs.py made (the
 *     layers come as detached idmapped mounts the zygote opened: attached
 *     in our mount namespace, then overlay's lower layers, with a layer of
 *     our own above them holding our /etc/hosts: write_hosts), ending with
 *     pivot_root into it (run_plan); drop the supplementary group that let
 *     us pass through the state directory;
 *  5. bring up loopback; rlimits (nofile, no core dumps);
 *  6. drop every capability outside the kept set (bounding, ambient,
 *     effective, permitted, inheritable), no_new_privs, the seccomp filter;
 *  7. fds 3 (control socket), 4 (ready pipe), 5 (writable layer), stdio on
 *     /dev/null, nothing else; then serve as init.
 *
 * A failing step writes 'E' step NUL errno NUL target NUL on the ready pipe
 * (one write, below PIPE_BUF, so it arrives whole) and exits; the spawner
 * turns it into the {"step", "errno", "target", "message"} the engine
 * reports.
 *
 * The child of a raw clone() must not trust libc's cached thread state
 * (musl keeps the zygote's thread id): no stdio, raise(), abort() or
 * threads here, and credentials and limits are set with raw system calls.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <net/if.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "forkyard.h"

/* linux/openat2.h, linux/seccomp.h, linux/capability.h: musl's headers do
 * not carry the kernel's. */
#define RESOLVE_NO_XDEV 0x01
#define RESOLVE_NO_MAGICLINKS 0x02
#define RESOLVE_NO_SYMLINKS 0x04
#define RESOLVE_BENEATH 0x08
#define SECCOMP_SET_MODE_FILTER 1
#define LINUX_CAPABILITY_VERSION_3 0x20080522
#ifndef MNT_DETACH
#define MNT_DETACH 2
#endif
#ifndef MOVE_MOUNT_F_EMPTY_PATH
#define MOVE_MOUNT_F_EMPTY_PATH 0x00000004
#endif

/* Beneath the directory, and never through a symlink: a template, or a
 * snapshot that sandbox code wrote, may plant /proc -> / to redirect a
 * mount onto the host. */
#define BENEATH (RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)

struct open_how {
    uint64_t flags, mode, resolve;
};
struct sock_filter_program {
    unsigned short length;
    const void *filter;
};
struct capability_header {
    uint32_t version;
    int pid;
};
struct capability_data {
    uint32_t effective, permitted, inheritable;
};

static int report_fd = -1;
static const struct spawn_request *spawning; /* the request this child was cloned for */

/* --- failure ------------------------------------------------------------------ */

/* Appends field and its NUL within buffer[0, limit), cutting it if need be. */
static size_t append(char *buffer, size_t at, size_t limit, const char *field) {
    if (at + 1 >= limit) return at;
    size_t length = strnlen(field, limit - at - 1);
    memcpy(buffer + at, field, length);
    buffer[at + length] = '\0';
    return at + length + 1;
}

__attribute__((noreturn)) static void fail(const char *step, const char *target, int error) {
    char report[PIPE_BUF];
    char number[16];
    size_t at = 1;
    report[0] = 'E';
    snprintf(number, sizeof number, "%d", error);
    at = append(report, at, sizeof report - 32, step);
    at = append(report, at, sizeof report - 16, number);
    at = append(report, at, sizeof report, target);
    (void)!write(report_fd, report, at);
    _exit(1);
}

/* --- the root filesystem plan --------------------------------------------------- */

static int root_fd = -1, layer_fd = -1;

static int open_beneath(int directory, const char *path, uint64_t flags, uint64_t resolve) {
    struct open_how how = {flags | O_CLOEXEC, 0, resolve};
    return (int)syscall(SYS_openat2, directory, path, &how, sizeof how);
}

static void fd_path(char *buffer, size_t size, int fd) { snprintf(buffer, size, "/proc/self/fd/%d", fd); }

/* How a relative target reads in errors: its path in the sandbox. */
static const char *shown(const struct step *step) {
    static char path[2 * MAX_FIELD + 4];
    if (step->target[0] == '/') return step->target;
    if (step->within[0]) snprintf(path, sizeof path, "/%s/%s", step->within, step->target);
    else snprintf(path, sizeof path, "/%s", step->target);
    return path;
}

/* The mount a relative target lives on: the new root, or a mount an earlier
 * step made on it.  Opened after that mount, and allowed to cross mounts: a
 * handle taken before it would still name the directory underneath.  Kept
 * for the steps that follow on the same mount (a dozen under /proc), until a
 * step mounts over it again (forget_within). */
static struct {
    const char *within;
    int fd;
} held_within = {NULL, -1};

static int open_within(const struct step *step) {
    if (!step->within[0]) return root_fd;
    if (held_within.fd >= 0 && strcmp(held_within.within, step->within) == 0) return held_within.fd;
    int fd = open_beneath(root_fd, step->within, O_PATH | O_DIRECTORY, BENEATH);
    if (fd < 0) fail("build root filesystem: open mount", shown(step), errno);
    if (held_within.fd >= 0) close(held_within.fd);
    held_within.within = step->within;
    held_within.fd = fd;
    return fd;
}

/* A mount on a target of the new root itself (say /dev) leaves a held
 * handle on that target naming the directory underneath. */
static void forget_within(const struct step *step) {
    if (step->within[0] || held_within.fd < 0) return;
    close(held_within.fd);
    held_within.fd = -1;
}

static void create_directory(int base, const struct step *step) {
    char parent[MAX_FIELD + 1];
    snprintf(parent, sizeof parent, "%s", step->target);
    char *slash = strrchr(parent, '/');
    const char *name = step->target;
    int directory = base;
    if (slash) {
        *slash = '\0';
        name = slash + 1;
        directory = open_beneath(base, parent, O_PATH | O_DIRECTORY | O_NOFOLLOW, BENEATH | RESOLVE_NO_XDEV);
        if (directory < 0) fail("build root filesystem: open parent of mount target", shown(step), errno);
    }
    /* mkdirat never follows a final symlink; a planted one makes the reopen
     * below fail.  The umask is 0 here, so /tmp keeps its sticky bit. */
    if (mkdirat(directory, name, step->mode) < 0 && errno != EEXIST)
        fail("build root filesystem: create mount target", shown(step), errno);
    if (directory != base) close(directory);
}

/* An O_PATH handle on a relative target, neither through a symlink nor
 * across a mount: it must be a plain entry of the mount named by `within`.
 * Returns -1 when the target is absent and the step says skip. */
static int open_target(const struct step *step) {
    int base = open_within(step);
    int creates = step->missing == MISSING_CREATE || step->op == OP_MKDIR;
    uint64_t flags = O_PATH | O_NOFOLLOW | (creates ? O_DIRECTORY : 0);
    int fd = open_beneath(base, step->target, flags, BENEATH | RESOLVE_NO_XDEV);
    if (fd < 0 && errno == ENOENT && creates) {
        create_directory(base, step);
        fd = open_beneath(base, step->target, flags, BENEATH | RESOLVE_NO_XDEV);
    }
    int error = errno;
    if (fd < 0 && error == ENOENT && step->missing == MISSING_SKIP) return -1;
    if (fd < 0) fail("build root filesystem: open mount target (a symlink, or not a directory?)", shown(step), error);
    return fd;
}

static void mount_step(const struct step *step, const char *target) {
    char name[96];
    if (mount(step->source, target, step->fstype, step->flags, step->data) == 0) return;
    int error = errno;
    snprintf(name, sizeof name, "build root filesystem: mount %s", step->fstype ? step->fstype : "bind");
    fail(name, shown(step), error);
}

/* An O_PATH handle on a host directory, in place of the one held before. */
static void hold_directory(int *held, const char *path, const char *step_name) {
    if (*held >= 0) close(*held);
    *held = openat(AT_FDCWD, path, O_PATH | O_DIRECTORY | O_CLOEXEC); /* not open(): see zygote.c */
    if (*held < 0) fail(step_name, path, errno);
}

static void write_all(int fd, const char *text, const char *target) {
    size_t length = strlen(text);
    while (length > 0) {
        ssize_t written = write(fd, text, length);
        if (written < 0 && errno == EINTR) continue;
        if (written <= 0) fail("build root filesystem: write the sandbox's hosts file", target, written < 0 ? errno : EIO);
        text += written;
        length -= (size_t)written;
    }
}

/* The sandbox's /etc/hosts, in a layer of its own that the overlay stacks
 * above the template's: the text the engine read from the template's layers
 * (step->data), this sandbox's hostname, then step->source; and, when the
 * request has one (a sandbox with a network: its resolver), its
 * /etc/resolv.conf, which hides the template's whatever that is.  The directory
 * is on the scratch tmpfs this child mounted a few steps ago, which holds
 * nothing but what the plan made: no entry in it was planted, and none is
 * followed (O_EXCL).  Charged to the sandbox, like its writable layer. */
static void write_hosts(const struct step *step) {
    if (mkdir(step->target, 0755) < 0) fail("build root filesystem: make the hosts layer", step->target, errno);
    int layer = openat(AT_FDCWD, step->target, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (layer < 0) fail("build root filesystem: open the hosts layer", step->target, errno);
    if (mkdirat(layer, "etc", step->mode) < 0) fail("build root filesystem: make the hosts layer", "etc", errno);
    int fd = openat(layer, "etc/hosts", O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) fail("build root filesystem: write the sandbox's hosts file", "/etc/hosts", errno);
    write_all(fd, step->data, "/etc/hosts");
    write_all(fd, spawning->hostname, "/etc/hosts");
    write_all(fd, step->source ? step->source : "\n", "/etc/hosts");
    close(fd);
    if (spawning->resolv[0]) {
        fd = openat(layer, "etc/resolv.conf", O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
        if (fd < 0) fail("build root filesystem: write the sandbox's resolv.conf", "/etc/resolv.conf", errno);
        write_all(fd, spawning->resolv, "/etc/resolv.conf");
        close(fd);
    }
    close(layer);
}

static void run_step(const struct step *step) {
    char path[64];
    int fd;
    int relative = step->target[0] && step->target[0] != '/';
    if (relative && root_fd < 0) fail("build root filesystem: plan", shown(step), EINVAL);
    switch (step->op) {
    case OP_MOUNT:
        if (!relative) {
            mount_step(step, step->target);
            return;
        }
        if ((fd = open_target(step)) < 0) return;
        /* Mounting on the handle, not on a path that could be swapped. */
        fd_path(path, sizeof path, fd);
        mount_step(step, path);
        close(fd);
        forget_within(step);
        return;
    case OP_BIND_REMOUNT: {
        if ((fd = open_target(step)) < 0) return;
        fd_path(path, sizeof path, fd);
        /* A host directory (an empty one, as a mask), or the target itself. */
        const char *source = step->source ? step->source : path;
        if (mount(source, path, NULL, step->source ? MS_BIND : MS_BIND | MS_REC, NULL) < 0)
            fail("build root filesystem: bind for a remount", shown(step), errno);
        close(fd);
        forget_within(step);
        /* The handle names the directory under the new bind; a remount must
         * name the bind itself (its root), so walk to the target again. */
        fd = open_beneath(open_within(step), step->target, O_PATH | O_NOFOLLOW, BENEATH);
        if (fd < 0) fail("build root filesystem: reopen for a remount", shown(step), errno);
        fd_path(path, sizeof path, fd);
        /* step->flags repeats nosuid, nodev, noexec: the kernel locks them on
         * mounts made in a user namespace and refuses a remount that drops them. */
        if (mount(NULL, path, NULL, step->flags, NULL) < 0)
            fail("build root filesystem: remount", shown(step), errno);
        close(fd);
        return;
    }
    case OP_MKDIR:
        if (relative) {
            close(open_target(step));
        } else if (mkdir(step->target, step->mode) < 0 && errno != EEXIST) {
            fail("build root filesystem: make directory", step->target, errno);
        }
        return;
    case OP_KEEP_LAYER:
        hold_directory(&layer_fd, step->target, "build root filesystem: open writable layer");
        return;
    case OP_CHDIR:
        if (chdir(step->target) < 0) fail("build root filesystem: enter directory", step->target, errno);
        return;
    case OP_ENTER_ROOT:
        hold_directory(&root_fd, step->target, "build root filesystem: open new root");
        if (held_within.fd >= 0) close(held_within.fd);
        held_within.fd = -1;
        return;
    case OP_ATTACH_LAYERS: {
        /* The zygote opened each layer as a detached mount, shifted into our
         * id range (it alone may make idmapped mounts: they need
         * CAP_SYS_ADMIN over the layers' filesystem).  A detached mount of
         * another mount namespace cannot be an overlay layer; attached here,
         * in ours, it can.  Named 0, 1, ...: short lowerdir options. */
        if (mkdir(step->target, 0700) < 0 && errno != EEXIST)
            fail("build root filesystem: make the layers' directory", step->target, errno);
        int directory = openat(AT_FDCWD, step->target, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (directory < 0) fail("build root filesystem: open the layers' directory", step->target, errno);
        for (size_t index = 0; index < spawning->layer_count; index++) {
            char name[24];
            snprintf(name, sizeof name, "%zu", index);
            if (mkdirat(directory, name, 0700) < 0 && errno != EEXIST)
                fail("build root filesystem: make a layer's mount point", name, errno);
            if (syscall(SYS_move_mount, spawning->layer_fds[index], "", directory, name, MOVE_MOUNT_F_EMPTY_PATH) < 0)
                fail("build root filesystem: attach layer", spawning->layers[index], errno);
            close(spawning->layer_fds[index]);
        }
        close(directory);
        return;
    }
    case OP_HOSTS:
        write_hosts(step);
        return;
    case OP_PIVOT:
        /* pivot_root(".", ".") stacks the old root on top of the new one at
         * the same place, so no directory for it is needed in the sandbox's
         * tree; detaching "." then drops the whole host tree from this mount
         * namespace. */
        if (fchdir(root_fd) < 0) fail("build root filesystem: enter new root", "/", errno);
        if (syscall(SYS_pivot_root, ".", ".") < 0) fail("build root filesystem: pivot_root", "/", errno);
        if (umount2(".", MNT_DETACH) < 0) fail("build root filesystem: detach old root", "/", errno);
        if (chdir("/") < 0) fail("build root filesystem: enter new root", "/", errno);
        close(root_fd);
        root_fd = -1;
        if (held_within.fd >= 0) close(held_within.fd);
        held_within.fd = -1;
        return;
    }
}

/* --- the process ----------------------------------------------------------------- */

static void become_root(void) {
    /* Raw system calls: libc's set*id would consult its thread list.  The
     * zygote's securebits kept its capabilities while it acted as our root;
     * ours must be the usual ones (a setuid to non-root drops capabilities). */
    if (prctl(PR_SET_SECUREBITS, 0, 0, 0, 0) < 0) fail("become root in the user namespace: securebits", "0", errno);
    if (syscall(SYS_setresgid, 0, 0, 0) < 0) fail("become root in the user namespace: setresgid", "0", errno);
    if (syscall(SYS_setresuid, 0, 0, 0) < 0) fail("become root in the user namespace: setresuid", "0", errno);
    /* The supplementary group the zygote gave us (the layers' range, which
     * may pass through the state directory) stays until the root is built:
     * dropped right after pivot_root (drop_groups). */
}

static void drop_groups(void) {
    if (syscall(SYS_setgroups, 0, NULL) < 0) fail("drop supplementary groups", "", errno);
}

static void loopback_up(void) {
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) fail("bring up loopback: socket", "lo", errno);
    struct ifreq request;
    memset(&request, 0, sizeof request);
    memcpy(request.ifr_name, "lo", 3);
    request.ifr_flags = IFF_UP | IFF_LOOPBACK;
    if (ioctl(fd, SIOCSIFFLAGS, &request) < 0) fail("bring up loopback", "lo", errno);
    close(fd);
}

static void set_limits(uint64_t nofile) {
    struct rlimit limit;
    if (syscall(SYS_prlimit64, 0, RLIMIT_NOFILE, NULL, &limit) < 0) fail("set rlimits: read nofile", "nofile", errno);
    /* Our hard limit is the spawner's, and no one in the sandbox can raise it. */
    if (nofile > limit.rlim_max) nofile = limit.rlim_max;
    limit.rlim_cur = limit.rlim_max = nofile;
    if (syscall(SYS_prlimit64, 0, RLIMIT_NOFILE, &limit, NULL) < 0) fail("set rlimits", "nofile", errno);
    limit.rlim_cur = limit.rlim_max = 0;
    if (syscall(SYS_prlimit64, 0, RLIMIT_CORE, &limit, NULL) < 0) fail("set rlimits", "core", errno);
}

static void drop_capabilities(uint64_t kept) {
    char name[16];
    for (int capability = 0; capability < 64; capability++) {
        if (kept & (1ULL << capability)) continue;
        if (prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) == 0) continue;
        if (errno == EINVAL) break; /* past the kernel's last capability */
        snprintf(name, sizeof name, "%d", capability);
        fail("drop capabilities: bounding set", name, errno);
    }
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0) fail("drop capabilities: ambient", "", errno);
    struct capability_header header = {LINUX_CAPABILITY_VERSION_3, 0};
    struct capability_data data[2];
    for (int word = 0; word < 2; word++) {
        uint32_t bits = (uint32_t)(kept >> (32 * word));
        data[word] = (struct capability_data){bits, bits, bits};
    }
    if (syscall(SYS_capset, &header, data) < 0) fail("drop capabilities: capset", "", errno);
}

static void install_filter(const struct confinement *confinement) {
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) fail("set no_new_privs", "", errno);
    struct sock_filter_program program = {confinement->filter_length, confinement->filter};
    if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &program) < 0) fail("install seccomp filter", "", errno);
}

/* fds 3, 4, 5 and stdio as init expects them; everything else closed. */
static void arrange_descriptors(const struct spawn_request *request) {
    int sources[3] = {request->listen_fd, request->ready_fd, layer_fd};
    int count = layer_fd >= 0 ? 3 : 2;
    /* Move them out of the way first, so that no dup2 clobbers a source. */
    for (int index = 0; index < count; index++) {
        sources[index] = fcntl(sources[index], F_DUPFD_CLOEXEC, 16);
        if (sources[index] < 0) fail("arrange file descriptors", "", errno);
    }
    for (int index = 0; index < count; index++) {
        if (dup2(sources[index], FD_LISTEN + index) < 0) fail("arrange file descriptors", "", errno);
    }
    report_fd = FD_READY;
    int null = openat(AT_FDCWD, "/dev/null", O_RDWR | O_CLOEXEC);
    if (null < 0) fail("arrange file descriptors: open", "/dev/null", errno);
    for (int stdio = 0; stdio < 3; stdio++) {
        if (dup2(null, stdio) < 0) fail("arrange file descriptors", "/dev/null", errno);
    }
    if (syscall(SYS_close_range, FD_LISTEN + count, ~0U, 0) < 0) fail("arrange file descriptors: close", "", errno);
}

void confine_and_serve(const struct spawn_request *request, const struct confinement *confinement, int sync_fd,
                       void (*release_buffers)(void)) {
    report_fd = request->ready_fd;
    close(FD_SPAWNER);
    /* Never dumpable, from the first instruction: once sandbox code runs it
     * must not ptrace us or open our /proc/1/fd (the writable layer). */
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0) fail("make init non-dumpable", request->hostname, errno);
    char released = 0;
    ssize_t got;
    do got = read(sync_fd, &released, 1);
    while (got < 0 && errno == EINTR);
    if (got != 1 || released != '1') _exit(1); /* the zygote gave up on us (and told the spawner) */
    close(sync_fd);

    if (unshare(CLONE_NEWCGROUP) < 0) fail("unshare cgroup namespace", request->hostname, errno);
    become_root();
    if (sethostname(request->hostname, strlen(request->hostname)) < 0)
        fail("set hostname", request->hostname, errno);
    umask(0);
    spawning = request;
    for (size_t index = 0; index < request->step_count; index++) run_step(&request->steps[index]);
    drop_groups();
    loopback_up();
    set_limits(request->nofile);
    drop_capabilities(confinement->kept_capabilities);
    install_filter(confinement);
    arrange_descriptors(request);
    if (prctl(PR_SET_NAME, "forkyard-init", 0, 0, 0) < 0) fail("name init", "forkyard-init", errno);
    /* The request and the zygote's other buffers are ours alone from the
     * zygote's next request on: a few pages per sandbox, for nothing. */
    release_buffers();
    _exit(init_serve());
}
