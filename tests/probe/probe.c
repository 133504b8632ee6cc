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
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: probe <name> [argument]\n");
        return 2;
    }
    const char *name = argv[1];
    const char *argument = argc > 2 ? argv[2] : "";
    setvbuf(stdout, NULL, _IOLBF, 0);

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
    if (!strcmp(name, "process_vm_readv")) return report(syscall(SYS_process_vm_readv, atoi(argument), NULL, 0, NULL, 0, 0));
    if (!strcmp(name, "mknod_char")) return report(mknod(argument, S_IFCHR | 0600, makedev(1, 3)));
    if (!strcmp(name, "tiocsti")) {
        char byte = 'x';
        return report(ioctl(0, TIOCSTI, &byte));
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
    if (!strcmp(name, "spin")) for (;;) {}

    fprintf(stderr, "unknown probe %s\n", name);
    return 2;
}
