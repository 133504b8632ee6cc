/*
 * probe: try one thing a sandbox must not be able to do, report what happened.
 *
 *     probe <name> [argument]   prints "RESULT <errno name | OK | value>"
 *
 * The tests run each probe twice: on the host as root (the control, which
 * shows the probe *can* succeed, or at least reach the kernel) and inside a
 * sandbox (which must be refused).  Probes that would harm the host if they
 * succeeded pass bad pointers or bad values, so "allowed" shows up as EFAULT
 * or EINVAL and "blocked" as EPERM, ENOSYS or a SIGSYS kill (the pattern of
 * bubblewrap's try-syscall).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <mqueue.h>
#include <sys/inotify.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/personality.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define BAD_POINTER ((void *)1)

static const struct { int number; const char *name; } NAMES[] = {
    {EPERM, "EPERM"}, {ENOENT, "ENOENT"}, {ESRCH, "ESRCH"}, {EINTR, "EINTR"}, {EIO, "EIO"},
    {ENXIO, "ENXIO"}, {EBADF, "EBADF"}, {ECHILD, "ECHILD"}, {EAGAIN, "EAGAIN"}, {ENOMEM, "ENOMEM"},
    {EACCES, "EACCES"}, {EFAULT, "EFAULT"}, {EBUSY, "EBUSY"}, {EEXIST, "EEXIST"}, {ENODEV, "ENODEV"},
    {ENOTDIR, "ENOTDIR"}, {EISDIR, "EISDIR"}, {EINVAL, "EINVAL"}, {EMFILE, "EMFILE"}, {ENOTTY, "ENOTTY"},
    {ETXTBSY, "ETXTBSY"}, {ENOSPC, "ENOSPC"}, {EROFS, "EROFS"}, {ENOSYS, "ENOSYS"}, {ELOOP, "ELOOP"},
    {EOPNOTSUPP, "EOPNOTSUPP"}, {EAFNOSUPPORT, "EAFNOSUPPORT"}, {ECONNREFUSED, "ECONNREFUSED"},
    {ENETUNREACH, "ENETUNREACH"}, {EHOSTUNREACH, "EHOSTUNREACH"}, {ETIMEDOUT, "ETIMEDOUT"},
    {EPROTONOSUPPORT, "EPROTONOSUPPORT"}, {ENOPKG, "ENOPKG"}, {EOVERFLOW, "EOVERFLOW"},
};

static int report_errno(int number) {
    for (size_t index = 0; index < sizeof NAMES / sizeof NAMES[0]; index++) {
        if (NAMES[index].number == number) {
            printf("RESULT %s\n", NAMES[index].name);
            return 0;
        }
    }
    printf("RESULT E%d\n", number);
    return 0;
}

/* A system call's return value: OK when it succeeded, else its errno. */
static int report(long result) {
    if (result >= 0) {
        printf("RESULT OK\n");
        return 0;
    }
    return report_errno(errno);
}

static int open_result(const char *path, int flags) {
    int fd = open(path, flags);
    if (fd >= 0) close(fd);
    return report(fd);
}

static int write_result(const char *path, const char *data) {
    int fd = open(path, O_WRONLY);
    if (fd < 0) return report(fd);
    long written = write(fd, data, strlen(data));
    int saved = errno;
    close(fd);
    errno = saved;
    return report(written);
}

static int connect_tcp(const char *argument) {
    /* argument: a.b.c.d:port */
    char host[64];
    strncpy(host, argument, sizeof host - 1);
    host[sizeof host - 1] = 0;
    char *colon = strchr(host, ':');
    if (!colon) return report_errno(EINVAL);
    *colon = 0;
    struct sockaddr_in address = {.sin_family = AF_INET, .sin_port = htons(atoi(colon + 1))};
    inet_pton(AF_INET, host, &address.sin_addr);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return report(fd);
    struct timeval timeout = {2, 0};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
    return report(connect(fd, (struct sockaddr *)&address, sizeof address));
}

/* The network benchmark's loads (bench/network_bench.py): COUNT connections one after the other, each
 * sending a line (and, with a hello file, that file's bytes first) and reading the answer; or MIB
 * mebibytes sent on one connection.  Each prints what it did and how long it took. */
static double now_s(void) {
    struct timespec at;
    clock_gettime(CLOCK_MONOTONIC, &at);
    return at.tv_sec + at.tv_nsec / 1e9;
}

static int open_to(const char *argument) {
    char host[64];
    strncpy(host, argument, sizeof host - 1);
    host[sizeof host - 1] = 0;
    char *colon = strchr(host, ':');
    if (!colon) return -1;
    *colon = 0;
    struct sockaddr_in address = {.sin_family = AF_INET, .sin_port = htons(atoi(colon + 1))};
    inet_pton(AF_INET, host, &address.sin_addr);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    if (connect(fd, (struct sockaddr *)&address, sizeof address) < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static int connect_many(const char *argument, int count, const char *hello_path) {
    static char hello[16384];
    ssize_t hello_size = 0;
    if (hello_path && *hello_path) {
        int file = open(hello_path, O_RDONLY);
        if (file >= 0) {
            hello_size = read(file, hello, sizeof hello);
            close(file);
        }
    }
    double started = now_s();
    int done = 0, failed = 0;
    for (int i = 0; i < count; i++) {
        int fd = open_to(argument);
        if (fd < 0) {
            failed++;
            continue;
        }
        char answer[256];
        if ((hello_size > 0 && write(fd, hello, hello_size) != hello_size) || (hello_size <= 0 && write(fd, "ping\n", 5) != 5) ||
            read(fd, answer, sizeof answer) <= 0)
            failed++;
        else
            done++;
        close(fd);
    }
    printf("CONNECTED %d FAILED %d SECONDS %.6f\n", done, failed, now_s() - started);
    return failed ? 1 : 0;
}

/* MIB MiB on one connection, after the contents of HEAD_PATH if one is given (a request's head, which the
 * name proxy reads the name from), then the peer's answer read to its end. */
static int send_mib(const char *argument, int mib, const char *head_path) {
    static char chunk[65536];
    memset(chunk, 'x', sizeof chunk);
    int fd = open_to(argument);
    if (fd < 0) return report_errno(errno);
    double started = now_s();
    if (head_path && *head_path) {
        char head[4096];
        int file = open(head_path, O_RDONLY);
        ssize_t size = file >= 0 ? read(file, head, sizeof head) : -1;
        if (file >= 0) close(file);
        if (size <= 0 || write(fd, head, size) != size) return report_errno(EIO);
    }
    long long sent = 0, wanted = (long long)mib << 20;
    while (sent < wanted) {
        ssize_t written = write(fd, chunk, sizeof chunk);
        if (written <= 0) break;
        sent += written;
    }
    shutdown(fd, SHUT_WR);
    char ack[64];
    while (read(fd, ack, sizeof ack) > 0) {
    }
    printf("SENT %lld SECONDS %.6f\n", sent, now_s() - started);
    close(fd);
    return sent == wanted ? 0 : 1;
}

/* A UDP datagram to a.b.c.d:port (the network probes: UDP where only TCP is allowed). */
static int udp_send(const char *argument, const char *message) {
    char host[64];
    strncpy(host, argument, sizeof host - 1);
    host[sizeof host - 1] = 0;
    char *colon = strchr(host, ':');
    if (!colon) return report_errno(EINVAL);
    *colon = 0;
    struct sockaddr_in address = {.sin_family = AF_INET, .sin_port = htons(atoi(colon + 1))};
    inet_pton(AF_INET, host, &address.sin_addr);
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    if (fd < 0) return report(fd);
    return report(sendto(fd, message, strlen(message), 0, (struct sockaddr *)&address, sizeof address));
}

/* An ICMP echo socket, datagram (unprivileged) then raw: a sandbox may open neither. */
static int icmp_socket(void) {
    int fd = socket(AF_INET, SOCK_DGRAM, IPPROTO_ICMP);
    if (fd >= 0) return report(fd);
    fd = socket(AF_INET, SOCK_RAW, IPPROTO_ICMP);
    return report(fd);
}

/* Netlink and nfnetlink's wire format (musl has no kernel headers; these are the kernel's ABI). */
#define NETLINK_NETFILTER 12
#define NLM_F_REQUEST 0x1
#define NLM_F_ACK 0x4
#define NLM_F_CREATE 0x400
#define NLMSG_ERROR 0x2
#define NFNL_MSG_BATCH_BEGIN 0x10
#define NFNL_MSG_BATCH_END 0x11
#define NFNL_SUBSYS_NFTABLES 10
#define NFT_MSG_NEWTABLE 0
#define NFTA_TABLE_NAME 1
#define ALIGN4(length) (((length) + 3) & ~3U)
struct nlmsghdr { uint32_t nlmsg_len; uint16_t nlmsg_type, nlmsg_flags; uint32_t nlmsg_seq, nlmsg_pid; };
struct nlmsgerr { int error; struct nlmsghdr msg; };
struct nfgenmsg { uint8_t nfgen_family, version; uint16_t res_id; };
struct nlattr { uint16_t nla_len, nla_type; };
struct sockaddr_nl { unsigned short nl_family, nl_pad; uint32_t nl_pid, nl_groups; };

/* Add an nftables table (named ARGUMENT) in its own network namespace, through nfnetlink as nft does:
 * a batch of one NEWTABLE, acknowledged. A sandbox has no CAP_NET_ADMIN: the kernel's answer is EPERM
 * (or the socket is refused); on the host, in a namespace of its own, the control gets OK. */
static size_t nfnl_message(char *at, uint16_t type, uint16_t flags, uint32_t seq, uint8_t family, const char *table) {
    struct nlmsghdr *header = (struct nlmsghdr *)at;
    struct nfgenmsg *generic = (struct nfgenmsg *)(at + sizeof *header);
    size_t length = sizeof *header + sizeof *generic;
    header->nlmsg_type = type;
    header->nlmsg_flags = flags;
    header->nlmsg_seq = seq;
    generic->nfgen_family = family;
    generic->res_id = htons(NFNL_SUBSYS_NFTABLES);
    if (table) {
        struct nlattr *name = (struct nlattr *)(at + length);
        size_t size = strnlen(table, 64) + 1;
        name->nla_type = NFTA_TABLE_NAME;
        name->nla_len = sizeof *name + size;
        memcpy((char *)name + sizeof *name, table, size - 1);
        length += ALIGN4(name->nla_len);
    }
    header->nlmsg_len = length;
    return ALIGN4(length);
}

static int nft_table(const char *argument) {
    int fd = socket(AF_NETLINK, SOCK_RAW, NETLINK_NETFILTER);
    if (fd < 0) return report(fd);
    char buffer[512];
    memset(buffer, 0, sizeof buffer);
    size_t at = nfnl_message(buffer, NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, 1, AF_UNSPEC, NULL);
    at += nfnl_message(buffer + at, (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWTABLE,
                       NLM_F_REQUEST | NLM_F_CREATE | NLM_F_ACK, 2, 1 /* NFPROTO_INET */, argument);
    at += nfnl_message(buffer + at, NFNL_MSG_BATCH_END, NLM_F_REQUEST, 3, AF_UNSPEC, NULL);
    struct sockaddr_nl kernel = {.nl_family = AF_NETLINK};
    if (sendto(fd, buffer, at, 0, (struct sockaddr *)&kernel, sizeof kernel) < 0) return report(-1);
    char answer[4096];
    ssize_t got = recv(fd, answer, sizeof answer, 0);
    if (got < 0) return report(-1);
    for (size_t offset = 0; offset + sizeof(struct nlmsghdr) <= (size_t)got;) {
        struct nlmsghdr *header = (struct nlmsghdr *)(answer + offset);
        if (header->nlmsg_len < sizeof *header) break;
        if (header->nlmsg_type == NLMSG_ERROR) {
            struct nlmsgerr *error = (struct nlmsgerr *)(answer + offset + sizeof *header);
            if (error->error) return report_errno(-error->error);
            printf("RESULT OK\n");
            return 0;
        }
        offset += ALIGN4(header->nlmsg_len);
    }
    printf("RESULT NOANSWER\n");
    return 0;
}

static int i386_syscall(void) {
    /* getpid through the 32-bit entry point: a different ABI the filter must refuse. */
    long result;
    __asm__ volatile("int $0x80" : "=a"(result) : "a"(20) : "memory");
    if (result < 0) return report_errno((int)-result);
    printf("RESULT OK\n");
    return 0;
}

static int x32_syscall(void) {
    long result = syscall(0x40000000 | SYS_getpid);
    return report(result);
}

static int memory_hog(void) {
    /* Touch memory until something stops us; print how far we got. */
    size_t total = 0;
    for (;;) {
        char *block = malloc(1 << 20);
        if (!block) return report_errno(ENOMEM);
        memset(block, 1, 1 << 20);
        total += 1;
        if (total % 64 == 0) {
            printf("MiB %zu\n", total);
            fflush(stdout);
        }
    }
}

/* Allocate and touch `mib` MiB, say so, then keep it until killed. */
static int hold_memory(int mib) {
    for (int index = 0; index < mib; index++) {
        char *block = malloc(1 << 20);
        if (!block) return report_errno(ENOMEM);
        memset(block, 1, 1 << 20);
    }
    printf("RESULT OK\n");
    fflush(stdout);
    for (;;) pause();
}

/* Take a per-user kernel object until the kernel refuses one; report how
 * many and why, then hold them until killed (another sandbox then probes). */
__attribute__((noreturn)) static void hold_until_refused(const char *kind) {
    int count = 0;
    for (;;) {
        int result;
        if (!strcmp(kind, "inotify")) {
            result = inotify_init1(IN_CLOEXEC);
        } else {
            char name[32];
            snprintf(name, sizeof name, "/probe-held-%d", count);
            result = (int)mq_open(name, O_CREAT | O_RDWR | O_CLOEXEC, 0600, NULL);
        }
        if (result < 0) break;
        count++;
    }
    int saved = errno;
    printf("COUNT %d\n", count);
    report_errno(saved);
    fflush(stdout);
    for (;;) pause();
}

static int fd_exhaustion(void) {
    int count = 0;
    for (;;) {
        int fd = open("/dev/null", O_RDONLY);
        if (fd < 0) {
            printf("COUNT %d\n", count);
            return report_errno(errno);
        }
        count++;
    }
}

static int list_fds(void) {
    /* The fds this process holds, to compare with an allowlist. */
    char path[64];
    printf("FDS");
    for (int fd = 0; fd < 1024; fd++) {
        snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
        if (access(path, F_OK) == 0 || fcntl(fd, F_GETFD) >= 0) printf(" %d", fd);
    }
    printf("\nRESULT OK\n");
    return 0;
}

/* Remove a tree (no nftw: keep to what every libc has). */
static void remove_tree(const char *path) {
    DIR *directory = opendir(path);
    if (!directory) {
        unlink(path);
        return;
    }
    struct dirent *entry;
    char child[4096];
    while ((entry = readdir(directory))) {
        if (!strcmp(entry->d_name, ".") || !strcmp(entry->d_name, "..")) continue;
        snprintf(child, sizeof child, "%s/%s", path, entry->d_name);
        struct stat info;
        if (lstat(child, &info) == 0 && S_ISDIR(info.st_mode)) remove_tree(child);
        else unlink(child);
    }
    closedir(directory);
    rmdir(path);
}

static void populate(const char *root) {
    char path[4096];
    mkdir(root, 0755);
    for (int index = 0; index < 20; index++) {
        snprintf(path, sizeof path, "%s/d%d", root, index);
        mkdir(path, 0755);
        for (int file = 0; file < 50; file++) {
            snprintf(path, sizeof path, "%s/d%d/f%d", root, index, file);
            int fd = open(path, O_CREAT | O_WRONLY | O_TRUNC, 0644);
            if (fd >= 0) {
                (void)!write(fd, path, strlen(path));
                close(fd);
            }
        }
    }
}

/* Hostile to whoever walks the tree: rename it away, make it again, remove
 * the old one, forever (each file's content is its own path). */
__attribute__((noreturn)) static void churn(const char *root) {
    char old[4096];
    snprintf(old, sizeof old, "%s.old", root);
    populate(root);
    printf("RESULT OK\n");
    fflush(stdout);
    for (;;) {
        rename(root, old);
        populate(root);
        remove_tree(old);
    }
}

/* Nest the tree one level deeper at a time (root becomes root/n), as a
 * walker reads it, until it is `depth` deep. */
static int nest(const char *root, int depth) {
    char moved[4096], inner[4096];
    snprintf(moved, sizeof moved, "%s.moving", root);
    snprintf(inner, sizeof inner, "%s/n", root);
    mkdir(root, 0755);
    for (int level = 1; level < depth; level++) {
        rename(root, moved);
        mkdir(root, 0755);
        rename(moved, inner);
    }
    printf("RESULT OK\n");
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: probe <name> [argument]\n");
        return 2;
    }
    const char *name = argv[1];
    const char *argument = argc > 2 ? argv[2] : "";
    setvbuf(stdout, NULL, _IOLBF, 0);

    if (!strcmp(name, "connect_many")) return connect_many(argument, argc > 3 ? atoi(argv[3]) : 100, argc > 4 ? argv[4] : "");
    if (!strcmp(name, "send_mib")) return send_mib(argument, argc > 3 ? atoi(argv[3]) : 64, argc > 4 ? argv[4] : "");
    if (!strcmp(name, "udp_send")) return udp_send(argument, argc > 3 ? argv[3] : "datagram\n");
    if (!strcmp(name, "icmp_socket")) return icmp_socket();
    if (!strcmp(name, "nft_table")) return nft_table(argument);

    /* Kernel surface (bad arguments: allowed => EFAULT/EINVAL, blocked => EPERM). */
    if (!strcmp(name, "mount")) return report(mount(BAD_POINTER, BAD_POINTER, BAD_POINTER, 0, NULL));
    if (!strcmp(name, "umount")) return report(umount2(BAD_POINTER, 0));
    if (!strcmp(name, "pivot_root")) return report(syscall(SYS_pivot_root, BAD_POINTER, BAD_POINTER));
    if (!strcmp(name, "unshare_user")) return report(unshare(CLONE_NEWUSER));
    if (!strcmp(name, "unshare_mount")) return report(unshare(CLONE_NEWNS));
    if (!strcmp(name, "clone_newuser")) {
        long pid = syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0);
        if (pid == 0) _exit(0);
        if (pid > 0) waitpid(pid, NULL, 0);
        return report(pid);
    }
    if (!strcmp(name, "clone3")) return report(syscall(SYS_clone3, BAD_POINTER, 88));
    if (!strcmp(name, "setns")) return report(setns(-1, 0));
    if (!strcmp(name, "keyctl")) return report(syscall(SYS_keyctl, 0x7fffffff, 0, 0, 0, 0));
    if (!strcmp(name, "add_key")) return report(syscall(SYS_add_key, BAD_POINTER, BAD_POINTER, NULL, 0, 0));
    if (!strcmp(name, "request_key")) return report(syscall(SYS_request_key, BAD_POINTER, BAD_POINTER, NULL, 0));
    if (!strcmp(name, "bpf")) return report(syscall(SYS_bpf, -1, NULL, 0));
    if (!strcmp(name, "perf_event_open")) return report(syscall(SYS_perf_event_open, BAD_POINTER, 0, -1, -1, 0));
    if (!strcmp(name, "userfaultfd")) return report(syscall(SYS_userfaultfd, -1));
    if (!strcmp(name, "io_uring_setup")) return report(syscall(SYS_io_uring_setup, 0, BAD_POINTER));
    if (!strcmp(name, "open_by_handle_at")) return report(syscall(SYS_open_by_handle_at, -1, BAD_POINTER, 0));
    if (!strcmp(name, "init_module")) return report(syscall(SYS_init_module, BAD_POINTER, 0, BAD_POINTER));
    if (!strcmp(name, "finit_module")) return report(syscall(SYS_finit_module, -1, BAD_POINTER, 0));
    if (!strcmp(name, "kexec_load")) return report(syscall(SYS_kexec_load, 0, 0, NULL, 0xffffffffUL));
    if (!strcmp(name, "reboot")) return report(syscall(SYS_reboot, 0, 0, 0, NULL));
    if (!strcmp(name, "swapon")) return report(syscall(SYS_swapon, BAD_POINTER, 0));
    if (!strcmp(name, "acct")) return report(syscall(SYS_acct, BAD_POINTER));
    if (!strcmp(name, "clock_settime")) return report(syscall(SYS_clock_settime, CLOCK_REALTIME, BAD_POINTER));
    if (!strcmp(name, "settimeofday")) return report(syscall(SYS_settimeofday, BAD_POINTER, NULL));
    if (!strcmp(name, "syslog")) return report(syscall(SYS_syslog, 999, NULL, 0));
    /* Reading the LDT with a bad pointer: allowed => OK (no LDT) or EFAULT. */
    if (!strcmp(name, "modify_ldt")) return report(syscall(SYS_modify_ldt, 0, BAD_POINTER, 16));
    if (!strcmp(name, "process_vm_readv")) return report(syscall(SYS_process_vm_readv, atoi(argument), NULL, 0, NULL, 0, 0));
    if (!strcmp(name, "mknod_char")) return report(mknod(argument, S_IFCHR | 0600, makedev(1, 3)));
    if (!strcmp(name, "tiocsti")) {
        char byte = 'x';
        return report(ioctl(0, TIOCSTI, &byte));
    }
    if (!strcmp(name, "btrfs_subvolume")) {
        /* A subvolume made under a directory of the sandbox's disk would have a quota group of its own, with
         * no limit: writes there would escape the sandbox's disk quota. Allowed => OK (on a btrfs directory);
         * refused => EPERM. */
        struct { int64_t fd; char name[4088]; } volume = {0, "probe-subvolume"};
        int directory = open(argument, O_RDONLY | O_DIRECTORY);
        if (directory < 0) return report(-1);
        return report(ioctl(directory, _IOW(0x94, 14, volume), &volume));
    }
    if (!strcmp(name, "af_alg")) return report(socket(38 /* AF_ALG */, SOCK_SEQPACKET, 0));
    if (!strcmp(name, "af_vsock")) return report(socket(40 /* AF_VSOCK */, SOCK_STREAM, 0));
    if (!strcmp(name, "raw_socket")) return report(socket(AF_INET, SOCK_RAW, IPPROTO_RAW));
    if (!strcmp(name, "packet_socket")) return report(socket(17 /* AF_PACKET */, SOCK_RAW, 0));
    if (!strcmp(name, "personality")) return report(personality(ADDR_NO_RANDOMIZE));
    if (!strcmp(name, "personality_query")) return report(personality(0xffffffff));
    if (!strcmp(name, "i386_syscall")) return i386_syscall();
    if (!strcmp(name, "x32_syscall")) return x32_syscall();
    if (!strcmp(name, "ptrace_attach")) return report(ptrace(PTRACE_ATTACH, atoi(argument), NULL, NULL));
    if (!strcmp(name, "kill")) return report(kill(atoi(argument), 0));
    if (!strcmp(name, "lo_down")) {
        /* Changing an interface needs CAP_NET_ADMIN, which a sandbox lacks. */
        struct { char name[16]; short flags; char pad[24]; } request = {"lo", 0, {0}};
        int fd = socket(AF_INET, SOCK_DGRAM, 0);
        return report(ioctl(fd, 0x8914 /* SIOCSIFFLAGS */, &request));
    }

    /* Files: kernel interfaces that must be hidden, masked or read-only. */
    if (!strcmp(name, "open_read")) return open_result(argument, O_RDONLY);
    if (!strcmp(name, "open_write")) return open_result(argument, O_WRONLY);
    if (!strcmp(name, "write")) return write_result(argument, argc > 3 ? argv[3] : "1");
    if (!strcmp(name, "read_first_byte")) {
        int fd = open(argument, O_RDONLY);
        if (fd < 0) return report(fd);
        char byte;
        long count = read(fd, &byte, 1);
        if (count == 0) {
            printf("RESULT EMPTY\n");
            return 0;
        }
        return report(count);
    }

    /* Network. */
    if (!strcmp(name, "connect")) return connect_tcp(argument);

    /* Resources. */
    if (!strcmp(name, "memory_hog")) return memory_hog();
    if (!strcmp(name, "fd_exhaustion")) return fd_exhaustion();
    if (!strcmp(name, "fds")) return list_fds();
    if (!strcmp(name, "hold_memory")) return hold_memory(atoi(argument));

    /* Per-user kernel limits (counted per host uid and user namespace owner). */
    if (!strcmp(name, "inotify_init")) return report(inotify_init1(IN_CLOEXEC));
    if (!strcmp(name, "mq_open")) {
        mqd_t queue = mq_open("/probe-one", O_CREAT | O_RDWR | O_CLOEXEC, 0600, NULL);
        if (queue != (mqd_t)-1) mq_unlink("/probe-one");
        return report(queue == (mqd_t)-1 ? -1 : 0);
    }
    if (!strcmp(name, "hold_inotify")) hold_until_refused("inotify");
    if (!strcmp(name, "hold_mqueues")) hold_until_refused("mqueue");
    if (!strcmp(name, "spin")) for (;;) {}

    /* Trees that change under whoever reads them. */
    if (!strcmp(name, "churn")) churn(argument);
    if (!strcmp(name, "nest")) return nest(argument, argc > 3 ? atoi(argv[3]) : 1000);

    fprintf(stderr, "unknown probe %s\n", name);
    return 2;
}
