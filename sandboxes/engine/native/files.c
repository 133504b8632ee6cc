/*
 * The sandbox's file writer: what the engine's file API changes in a sandbox,
 * done by a process of the sandbox itself.
 *
 * Why a process of the sandbox: memory is charged to the memory cgroup of
 * the process that allocates it (for a page, the owner of the mm that
 * writes it).  When the engine wrote a sandbox's files from its own threads,
 * the tmpfs pages of the writable layer, the page cache, and the inodes and
 * dentries (kernel memory) were all charged to the engine: an upload larger
 * than the sandbox's memory went through, and the sandbox could then
 * allocate its whole limit again.  This process is a child of init (init.c
 * forks it on an 'F' request), so it sits in the sandbox's cgroups, user
 * namespace, mount namespace and root: every page and inode it makes counts
 * against the sandbox's own limits (memory, the tmpfs's size and inodes),
 * and it can reach nothing the sandbox cannot.  It runs confined exactly
 * like init (capabilities, no_new_privs, seccomp), as root of the sandbox.
 *
 * It still resolves every path the way the engine's trees.py does, with
 * openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV) from
 * the sandbox's root, and walks directories it removes one fd at a time
 * with O_NOFOLLOW, never past a mount: a sandbox's own symlinks, FIFOs and
 * mount points are handled as the engine handled them.
 *
 * It is the first process the kernel's OOM killer picks in the sandbox
 * (oom_score_adj 1000): a write that does not fit in the sandbox's memory
 * ends this process, never the sandbox's own.  The engine holds the file
 * being written (it gets it right after it is opened) and empties it, so
 * that a failed write does not leave the sandbox's memory full.
 *
 * Protocol, on the connection init handed over, one message per packet
 * (host byte order):
 *   request  struct file_request, then path\0 [text\0]; a 'W' carries one
 *            descriptor, the read end of a pipe with the file's content.
 *     'W' write a regular file (create or truncate, then the pipe's bytes
 *         until EOF); flags FILE_REPLACE: first remove a non-directory (or
 *         an empty directory) at the name, as a tar member replaces it;
 *         FILE_MTIME: set the times from mtime_ns
 *     'D' make directories (mkdir -p, one verified component at a time)
 *     'L' symlink at path to text (whatever was at path is removed first)
 *     'H' hard link at path to the existing text (likewise)
 *     'R' remove path; FILE_RECURSIVE: with everything below it
 *     'M' chmod the directory at path
 *     'N' rename path to text; FILE_REPLACE: replace what is at text (a
 *         file, or an empty directory for a directory), else never
 *         (RENAME_NOREPLACE); both resolved as every other path
 *   reply    'O' + descriptor   (a 'W' opened its file; then its 'K' or 'E')
 *            'K' i64 value      done (bytes written; 1 or 0 for a remove)
 *            'E' i32 errno text\0   failed; text is the file type for a 'W'
 *                                   that found no regular file, the
 *                                   component that failed for a 'D',
 *                                   "mount point" for a removal (or a
 *                                   rename) that reached another mount,
 *                                   "target" when a rename's target (not
 *                                   its source) is in the way, or "target
 *                                   path" when its parent cannot be found
 * The writer exits when the engine closes the connection.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "forkyard.h"

#define RESOLVE_NO_XDEV 0x01
#define RESOLVE_NO_MAGICLINKS 0x02
#define RESOLVE_IN_ROOT 0x10
#define IN_SANDBOX (RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV)
#define STATX_MNT_ID 0x1000

enum { FILE_REPLACE = 1, FILE_MTIME = 2, FILE_RECURSIVE = 4 };
/* What the writer says of a directory it will not remove: another mount. */
static const char MOUNT_POINT[] = "mount point";
enum { MAX_FILE_REQUEST = 2 * 4096 + 256, MAX_REMOVE_DEPTH = 1024, COPY_CHUNK = 1 << 20 };

struct file_request {
    char op;
    uint8_t reserved[3];
    uint32_t mode, uid, gid, flags;
    uint32_t reserved2;
    int64_t mtime_ns;
};

struct open_how {
    uint64_t flags, mode, resolve;
};

static int connection = -1, root = -1;
static uint64_t root_mount;
static char message[MAX_FILE_REQUEST + 1];

/* --- replies ------------------------------------------------------------------------ */

static void send_packet(const void *data, size_t length, int fd) {
    struct iovec vector = {(void *)data, length};
    union {
        char buffer[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } control;
    struct msghdr header = {0};
    header.msg_iov = &vector;
    header.msg_iovlen = 1;
    if (fd >= 0) {
        header.msg_control = control.buffer;
        header.msg_controllen = sizeof control.buffer;
        struct cmsghdr *cmsg = CMSG_FIRSTHDR(&header);
        cmsg->cmsg_level = SOL_SOCKET;
        cmsg->cmsg_type = SCM_RIGHTS;
        cmsg->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cmsg), &fd, sizeof fd);
    }
    while (sendmsg(connection, &header, MSG_NOSIGNAL) < 0 && errno == EINTR) {}
}

static void reply_done(int64_t value) {
    char packet[9] = {'K'};
    memcpy(packet + 1, &value, sizeof value);
    send_packet(packet, sizeof packet, -1);
}

static void reply_error(int error, const char *text) {
    char packet[16 + 4096];
    size_t length = strnlen(text, 4095);
    int32_t number = error;
    packet[0] = 'E';
    memcpy(packet + 1, &number, sizeof number);
    memcpy(packet + 5, text, length);
    packet[5 + length] = '\0';
    send_packet(packet, 6 + length, -1);
}

/* --- resolving, as trees.py does ------------------------------------------------------ */

static int open_in_root(const char *path, int flags, mode_t mode) {
    struct open_how how = {(uint64_t)(flags | O_CLOEXEC), (flags & O_CREAT) ? mode : 0, IN_SANDBOX};
    for (;;) {
        long fd = syscall(SYS_openat2, root, path, &how, sizeof how);
        if (fd >= 0 || errno != EAGAIN) return (int)fd; /* EAGAIN: a rename raced the walk */
    }
}

static int mount_of(int fd, uint64_t *id) {
    unsigned char buffer[256];
    if (syscall(SYS_statx, fd, "", AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW, STATX_MNT_ID, buffer) < 0) return -1;
    memcpy(id, buffer + 144, sizeof *id); /* struct statx: stx_mnt_id */
    return 0;
}

/* Split path (relative, as the engine sends it) into its parent, opened as an
 * O_PATH directory, and its last name.  path is changed in place. */
static int open_parent(char *path, const char **name) {
    char *slash = strrchr(path, '/');
    const char *parent = ".";
    *name = path;
    if (slash) {
        *slash = '\0';
        parent = path;
        *name = slash + 1;
    }
    if (!**name || !strcmp(*name, ".") || !strcmp(*name, "..")) {
        errno = EINVAL;
        return -1;
    }
    return open_in_root(parent, O_PATH | O_DIRECTORY, 0);
}

static const char *type_name(mode_t mode) {
    if (S_ISDIR(mode)) return "directory";
    if (S_ISFIFO(mode)) return "fifo";
    if (S_ISSOCK(mode)) return "socket";
    if (S_ISLNK(mode)) return "symlink";
    return "device";
}

/* --- removing -------------------------------------------------------------------------- */

static int remove_entry(int parent, const char *name, int recursive, int depth);

/* Empty a directory we hold open, one entry at a time; never past a mount. */
static int empty_directory(int directory, int depth) {
    uint64_t id;
    if (mount_of(directory, &id) < 0) return -1;
    if (id != root_mount) {
        errno = EXDEV; /* a mount point inside the tree (/proc, /dev): not ours to remove */
        return -1;
    }
    if (depth > MAX_REMOVE_DEPTH) {
        errno = ELOOP;
        return -1;
    }
    for (;;) {
        /* Names first, then removals: a directory changed while it is read
         * may skip entries; reading again until it is empty does not. */
        int reading = dup(directory);
        if (reading < 0) return -1;
        DIR *listing = fdopendir(reading);
        if (!listing) {
            close(reading);
            return -1;
        }
        size_t count = 0;
        struct dirent *entry;
        int failed = 0;
        while ((entry = readdir(listing))) {
            if (!strcmp(entry->d_name, ".") || !strcmp(entry->d_name, "..")) continue;
            count++;
            if (remove_entry(directory, entry->d_name, 1, depth + 1) < 0 && errno != ENOENT) {
                failed = errno;
                break;
            }
        }
        closedir(listing);
        if (failed) {
            errno = failed;
            return -1;
        }
        if (count == 0) return 0;
    }
}

/* 1 removed, 0 there was nothing, -1 failed (errno). */
static int remove_entry(int parent, const char *name, int recursive, int depth) {
    struct stat info;
    if (fstatat(parent, name, &info, AT_SYMLINK_NOFOLLOW) < 0) return errno == ENOENT ? 0 : -1;
    if (!S_ISDIR(info.st_mode)) return unlinkat(parent, name, 0) < 0 ? -1 : 1;
    if (recursive) {
        int directory = openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (directory < 0) return -1;
        int emptied = empty_directory(directory, depth);
        int saved = errno;
        close(directory);
        if (emptied < 0) {
            errno = saved;
            return -1;
        }
    }
    return unlinkat(parent, name, AT_REMOVEDIR) < 0 ? -1 : 1;
}

/* --- the operations ----------------------------------------------------------------------- */

static int copy_content(int source, int target, int64_t *copied) {
    static char buffer[64 * 1024];
    int use_splice = 1;
    for (;;) {
        ssize_t moved;
        if (use_splice) {
            moved = splice(source, NULL, target, NULL, COPY_CHUNK, SPLICE_F_MOVE);
            if (moved < 0 && errno == EINVAL) {
                use_splice = 0; /* a filesystem without splice: copy */
                continue;
            }
        } else {
            moved = read(source, buffer, sizeof buffer);
            if (moved > 0) {
                for (ssize_t done = 0; done < moved;) {
                    ssize_t written = write(target, buffer + done, (size_t)(moved - done));
                    if (written < 0) {
                        if (errno == EINTR) continue;
                        return -1;
                    }
                    done += written;
                }
            }
        }
        if (moved < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (moved == 0) return 0;
        *copied += moved;
    }
}

static void write_file(const struct file_request *request, char *path, int content) {
    if (request->flags & FILE_REPLACE) {
        /* A tar member replaces a symlink or a file at its name rather than
         * writing through it; a directory only if it is empty. */
        char parent_path[MAX_FIELD + 1];
        const char *name;
        size_t length = strnlen(path, MAX_FIELD);
        memcpy(parent_path, path, length);
        parent_path[length] = '\0';
        int parent = open_parent(parent_path, &name);
        if (parent >= 0) {
            (void)remove_entry(parent, name, 0, 0);
            close(parent);
        }
    }
    int fd = open_in_root(path, O_WRONLY | O_CREAT | O_NONBLOCK, request->mode & 07777);
    if (fd < 0) {
        /* The content's pipe closed too: the engine, feeding it before it reads this answer, sees EPIPE
         * at once instead of waiting for room that never comes (a full disk refuses the file itself). */
        int saved = errno;
        close(content);
        return reply_error(saved, "");
    }
    struct stat info;
    int64_t copied = 0;
    if (fstat(fd, &info) < 0) {
        reply_error(errno, "");
    } else if (!S_ISREG(info.st_mode)) {
        reply_error(EINVAL, type_name(info.st_mode));
    } else if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) < 0 || ftruncate(fd, 0) < 0 || fchown(fd, request->uid, request->gid) < 0 ||
               fchmod(fd, request->mode & 01777) < 0) { /* no setuid or setgid from outside */
        reply_error(errno, "");
    } else {
        send_packet("O", 1, fd);
        int failed = 0;
        if (copy_content(content, fd, &copied) < 0) {
            failed = errno;
            close(content); /* the engine stops feeding (EPIPE) and empties the file */
            content = -1;
        } else {
            struct timespec times[2];
            times[0].tv_sec = times[1].tv_sec = request->mtime_ns / 1000000000;
            times[0].tv_nsec = times[1].tv_nsec = request->mtime_ns % 1000000000;
            if ((request->flags & FILE_MTIME) && futimens(fd, times) < 0) failed = errno;
        }
        /* Closed before the answer: once the engine hears it, nothing of ours holds the file open to
         * write, so running it at once is not "Text file busy". */
        close(fd);
        if (content >= 0) close(content);
        if (failed) reply_error(failed, "");
        else reply_done(copied);
        return;
    }
    close(fd);
    if (content >= 0) close(content);
}

static void make_directories(const struct file_request *request, const char *path) {
    char built[MAX_FIELD + 1];
    size_t length = strlen(path);
    if (!strcmp(path, ".")) return reply_done(0);
    for (size_t end = 0; end <= length; end++) {
        if (path[end] != '/' && path[end] != '\0') continue;
        memcpy(built, path, end);
        built[end] = '\0';
        const char *name;
        char parent_path[MAX_FIELD + 1];
        memcpy(parent_path, built, end + 1);
        int parent = open_parent(parent_path, &name);
        if (parent < 0) return reply_error(errno, built);
        if (mkdirat(parent, name, request->mode & 07777) == 0) {
            /* fchownat on the name we just made, never following a link. */
            if (fchownat(parent, name, request->uid, request->gid, AT_SYMLINK_NOFOLLOW) < 0) {
                int saved = errno;
                close(parent);
                return reply_error(saved, built);
            }
        } else if (errno != EEXIST) {
            int saved = errno;
            close(parent);
            return reply_error(saved, built);
        }
        close(parent);
    }
    int check = open_in_root(path, O_PATH | O_DIRECTORY, 0);
    if (check < 0) return reply_error(errno, path);
    close(check);
    reply_done(0);
}

static void make_link(const struct file_request *request, char *path, char *text_of_link) {
    const char *name, *source_name = NULL;
    int source_parent = -1;
    if (request->op == 'H') {
        source_parent = open_parent(text_of_link, &source_name);
        if (source_parent < 0) return reply_error(errno, "");
    }
    int parent = open_parent(path, &name);
    if (parent < 0) {
        int saved = errno;
        if (source_parent >= 0) close(source_parent);
        return reply_error(saved, "");
    }
    int result = remove_entry(parent, name, 1, 0);
    const char *text = result < 0 && errno == EXDEV ? MOUNT_POINT : "";
    if (result >= 0) {
        if (request->op == 'L') {
            result = symlinkat(text_of_link, parent, name);
            if (result == 0) result = fchownat(parent, name, request->uid, request->gid, AT_SYMLINK_NOFOLLOW);
        } else {
            result = linkat(source_parent, source_name, parent, name, 0);
        }
    }
    int saved = errno;
    close(parent);
    if (source_parent >= 0) close(source_parent);
    if (result < 0) return reply_error(saved, text);
    reply_done(0);
}

static void remove_path(const struct file_request *request, char *path) {
    const char *name;
    int parent = open_parent(path, &name);
    if (parent < 0) return reply_error(errno, "");
    int recursive = (request->flags & FILE_RECURSIVE) != 0;
    int removed;
    if (recursive) {
        removed = remove_entry(parent, name, 1, 0);
    } else {
        /* Not recursive: a directory goes only if it is empty. */
        struct stat info;
        if (fstatat(parent, name, &info, AT_SYMLINK_NOFOLLOW) < 0) removed = errno == ENOENT ? 0 : -1;
        else removed = unlinkat(parent, name, S_ISDIR(info.st_mode) ? AT_REMOVEDIR : 0) < 0 ? -1 : 1;
    }
    int saved = errno;
    close(parent);
    if (removed < 0) return reply_error(saved, saved == EXDEV ? MOUNT_POINT : "");
    reply_done(removed);
}

/* Rename one name to another, each parent resolved in the sandbox's root;
 * the kernel refuses what would leave the mount (EXDEV), a mount point
 * (EBUSY), a directory into itself (EINVAL), a file onto a directory
 * (EISDIR), a directory onto a file (ENOTDIR) or a full one (ENOTEMPTY). */
static void rename_path(const struct file_request *request, char *path, char *target) {
    const char *name, *target_name;
    int parent = open_parent(path, &name);
    if (parent < 0) return reply_error(errno, "");
    int target_parent = open_parent(target, &target_name);
    if (target_parent < 0) {
        int saved = errno;
        close(parent);
        return reply_error(saved, "target path");
    }
    unsigned flags = (request->flags & FILE_REPLACE) ? 0 : 1; /* RENAME_NOREPLACE */
    long result = syscall(SYS_renameat2, parent, name, target_parent, target_name, flags);
    int saved = errno;
    const char *text = "";
    if (result < 0) {
        struct stat info;
        if (saved == EXDEV || saved == EBUSY) text = MOUNT_POINT;
        else if (saved == EEXIST || saved == EISDIR || saved == ENOTEMPTY) text = "target";
        else if (saved == ENOTDIR && fstatat(parent, name, &info, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(info.st_mode)) text = "target";
    }
    close(parent);
    close(target_parent);
    if (result < 0) return reply_error(saved, text);
    reply_done(0);
}

static void change_mode(const struct file_request *request, const char *path) {
    int fd = open_in_root(path, O_RDONLY | O_DIRECTORY, 0);
    if (fd < 0) return reply_error(errno, "");
    int result = fchmod(fd, request->mode & 01777);
    int saved = errno;
    close(fd);
    if (result < 0) return reply_error(saved, "");
    reply_done(0);
}

/* One request; returns -1 when the connection is over. */
static int serve_one(void) {
    struct received received;
    ssize_t length = receive_message(connection, message, MAX_FILE_REQUEST, 0, &received);
    if (length < 0 && errno == EINTR) return 0;
    if (length <= 0) return -1;
    struct file_request request;
    int content = -1;
    if (received.truncated || (size_t)length < sizeof request + 2 || message[length - 1] != '\0') {
        close_received(&received);
        return -1;
    }
    memcpy(&request, message, sizeof request);
    message[length] = '\0';
    char *path = message + sizeof request;
    char *text = path + strlen(path) + 1;
    int has_text = text < message + length;
    if (request.op == 'W' && received.count == 1) {
        content = received.fds[0];
        received.count = 0;
    }
    close_received(&received);
    if (!path[0] || path[0] == '/' || strlen(path) > MAX_FIELD) {
        if (content >= 0) close(content);
        reply_error(EINVAL, "");
        return 0;
    }
    switch (request.op) {
    case 'W':
        if (content < 0) return -1;
        write_file(&request, path, content);
        return 0;
    case 'D':
        make_directories(&request, path);
        return 0;
    case 'L':
    case 'H':
        if (!has_text) return -1;
        make_link(&request, path, text);
        return 0;
    case 'R':
        remove_path(&request, path);
        return 0;
    case 'M':
        change_mode(&request, path);
        return 0;
    case 'N':
        if (!has_text || !text[0] || text[0] == '/' || strlen(text) > MAX_FIELD) {
            reply_error(EINVAL, "target path");
            return 0;
        }
        rename_path(&request, path, text);
        return 0;
    default:
        if (content >= 0) close(content);
        return -1;
    }
}

__attribute__((noreturn)) void files_serve(int fd) {
    connection = fd;
    (void)prctl(PR_SET_NAME, "forkyard-files", 0, 0, 0);
    /* init accepted the connection non-blocking; we wait on it. */
    int flags = fcntl(connection, F_GETFL);
    if (flags < 0 || fcntl(connection, F_SETFL, flags & ~O_NONBLOCK) < 0) _exit(1);
    /* The OOM killer's first choice in the sandbox: a write the sandbox has
     * no memory for ends here, not in one of the sandbox's processes.  Our
     * /proc files belong to host root while we are not dumpable (we were
     * never exec'd, so our memory still belongs to the zygote's user
     * namespace): dumpable just long enough to open the file.  Raising our
     * own score needs no privilege. */
    (void)prctl(PR_SET_DUMPABLE, 1, 0, 0, 0);
    int adjust = openat(AT_FDCWD, "/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    (void)prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    if (adjust < 0 || write(adjust, "1000", 4) != 4) _exit(1);
    close(adjust);
    root = openat(AT_FDCWD, "/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (root < 0 || mount_of(root, &root_mount) < 0) _exit(1);
    while (serve_one() == 0) {}
    _exit(0);
}
