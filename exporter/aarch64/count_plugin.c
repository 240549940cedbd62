/*
 * exporter's instruction counter: a TCG plugin for qemu-user (built by exporter/aarch64/counter.py).
 *
 *   qemu-aarch64 -plugin libcount.so,out=FILE ...
 *
 * Counts the guest instructions each vCPU (in qemu-user: each guest thread) executes, inline: every translated
 * block adds its instruction count to its vCPU's slot of a scoreboard when it starts executing, no callback per
 * block or instruction (about 1.1x slower than plain emulation).
 *
 * The guest marks a region with an unused syscall number (4242, argument: a tag): at each marker one line
 *     marker <pid> <vcpu> <tag> <count>
 * is appended to FILE, <count> being that vCPU's instructions so far. At exit:
 *     total <pid> <instructions of every vCPU>
 * A marker is counted in full before its line is written (a syscall ends its block), so the difference of two
 * markers includes one marker's own cost: the caller measures it with an empty pair and subtracts it.
 */
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <qemu-plugin.h>

QEMU_PLUGIN_EXPORT int qemu_plugin_version = QEMU_PLUGIN_VERSION;

#define MARKER 4242

static struct qemu_plugin_scoreboard *counts;
static qemu_plugin_u64 insns;
static int out = -1;

static void on_translate(qemu_plugin_id_t id, struct qemu_plugin_tb *tb)
{
    qemu_plugin_register_vcpu_tb_exec_inline_per_vcpu(tb, QEMU_PLUGIN_INLINE_ADD_U64, insns,
                                                      qemu_plugin_tb_n_insns(tb));
}

static void on_syscall(qemu_plugin_id_t id, unsigned int vcpu, int64_t num, uint64_t a1, uint64_t a2,
                       uint64_t a3, uint64_t a4, uint64_t a5, uint64_t a6, uint64_t a7, uint64_t a8)
{
    if (num != MARKER) {
        return;
    }
    /* one write() per line, O_APPEND: lines of forked children or a crash never interleave or get lost */
    dprintf(out, "marker %d %u %" PRIu64 " %" PRIu64 "\n", (int)getpid(), vcpu, a1,
            qemu_plugin_u64_get(insns, vcpu));
}

static void at_exit(qemu_plugin_id_t id, void *p)
{
    dprintf(out, "total %d %" PRIu64 "\n", (int)getpid(), qemu_plugin_u64_sum(insns));
    qemu_plugin_scoreboard_free(counts);
}

QEMU_PLUGIN_EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info, int argc, char **argv)
{
    const char *path = NULL;
    for (int i = 0; i < argc; i++) {
        if (strncmp(argv[i], "out=", 4) == 0) {
            path = argv[i] + 4;
        }
    }
    if (path == NULL) {
        fprintf(stderr, "count plugin: needs out=FILE\n");
        return -1;
    }
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd < 0) {
        perror("count plugin: out");
        return -1;
    }
    /* guest and qemu share the fd table: keep ours far above the numbers the guest is given (when the limit on
     * open files allows; else where it is) */
    out = fcntl(fd, F_DUPFD_CLOEXEC, 900);
    if (out < 0) {
        out = fd;
    } else {
        close(fd);
    }
    counts = qemu_plugin_scoreboard_new(sizeof(uint64_t));
    insns = qemu_plugin_scoreboard_u64(counts);
    qemu_plugin_register_vcpu_tb_trans_cb(id, on_translate);
    qemu_plugin_register_vcpu_syscall_cb(id, on_syscall);
    qemu_plugin_register_atexit_cb(id, at_exit, NULL);
    return 0;
}
