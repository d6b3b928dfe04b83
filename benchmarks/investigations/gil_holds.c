/* Who holds the GIL while the training thread waits for it: an LD_PRELOAD probe for
 * benchmarks/investigations/bench_gil_holds.py (diagnosis only; CPython 3.11 on Linux, not part of deck).
 *
 * CPython 3.11's GIL is a mutex, a condition variable and a `locked` flag
 * (Python/ceval_gil.h): a thread that finds it locked sleeps in pthread_cond_timedwait on the
 * GIL's condition, the holder drops it with pthread_cond_signal on that condition, and both
 * taking and dropping end with pthread_mutex_unlock of the GIL's mutex. Nothing else in CPython
 * waits on a condition with a timeout, so interposing these three calls sees:
 *
 * - each wait of the training thread for the GIL (its start, length, and the thread and Python
 *   frames that released the GIL just before it ended), and
 * - each stretch another thread held the GIL: from its unlock that ends a take to its unlock
 *   that ends a drop (wall and thread CPU time, the Python frames where it took and dropped it).
 *
 * Frames are read from the calling thread's own frame stack (its PyThreadState, found through
 * the GIL-state TLS), which is safe: the thread is inside the call being interposed. */
#define _GNU_SOURCE
#define Py_BUILD_CORE
#include <Python.h>
#include <internal/pycore_frame.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define FRAMES 3
#define NAME 64

typedef struct {
    char name[FRAMES][NAME];
    int line[FRAMES];
} where_t;

typedef struct {
    long tid;
    where_t at;
} release_t;

typedef struct {
    double t0, t1;
    release_t by;
} wait_t;

typedef struct {
    long tid;
    double t0, t1, cpu;
    where_t take, drop;
} hold_t;

static int (*real_timedwait)(pthread_cond_t *, pthread_mutex_t *, const struct timespec *);
static int (*real_signal)(pthread_cond_t *);
static int (*real_unlock)(pthread_mutex_t *);

static volatile int on;
static volatile long training_tid;
static pthread_cond_t *volatile gil_cond;   /* learnt from the training thread's first wait */
static pthread_mutex_t *volatile gil_mutex;

#define RELEASES 4096 /* a ring: the last releases, read when a wait ends */
static release_t releases[RELEASES];
static atomic_long n_releases;

#define WAITS 200000
static wait_t waits[WAITS];
static atomic_long n_waits;

#define HOLDS 400000
static hold_t holds[HOLDS];
static atomic_long n_holds;

/* Background threads' waits for the GIL: each ends when the holder (mostly the training thread,
 * dropping it around a torch op) wakes them, a futex wake-up on the holder's own CPU. */
static atomic_long n_background_waits;

static __thread int signalled; /* this thread signalled the GIL's condition: a drop follows */
static __thread int holding;
static __thread double took, took_cpu;
static __thread where_t took_at;

static double clock_s(clockid_t id) {
    struct timespec ts;
    clock_gettime(id, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static long tid(void) { return syscall(SYS_gettid); }

static void where(where_t *w) {
    memset(w, 0, sizeof *w);
    PyThreadState *ts = PyGILState_GetThisThreadState();
    if (ts == NULL || ts->cframe == NULL)
        return;
    _PyInterpreterFrame *f = ts->cframe->current_frame;
    for (int i = 0; i < FRAMES && f != NULL; ++i, f = f->previous) {
        PyCodeObject *code = f->f_code;
        if (code == NULL)
            break;
        PyObject *q = code->co_qualname;
        if (q != NULL && PyUnicode_IS_COMPACT_ASCII(q))
            strncpy(w->name[i], (const char *)PyUnicode_DATA(q), NAME - 1);
        w->line[i] = code->co_firstlineno;
    }
}

int pthread_cond_signal(pthread_cond_t *c) {
    if (real_signal == NULL)
        real_signal = dlsym(RTLD_NEXT, "pthread_cond_signal");
    if (on && c == gil_cond) {
        release_t *r = &releases[atomic_fetch_add(&n_releases, 1) % RELEASES];
        r->tid = tid();
        where(&r->at);
        signalled = 1;
    }
    return real_signal(c);
}

int pthread_cond_timedwait(pthread_cond_t *c, pthread_mutex_t *m, const struct timespec *t) {
    if (real_timedwait == NULL)
        real_timedwait = dlsym(RTLD_NEXT, "pthread_cond_timedwait");
    if (!on || tid() != training_tid) {
        if (on && c == gil_cond)
            atomic_fetch_add(&n_background_waits, 1);
        return real_timedwait(c, m, t);
    }
    gil_cond = c;
    gil_mutex = m;
    const double t0 = clock_s(CLOCK_MONOTONIC);
    const long before = atomic_load(&n_releases);
    const int rc = real_timedwait(c, m, t);
    const long i = atomic_fetch_add(&n_waits, 1);
    if (i < WAITS) {
        wait_t *w = &waits[i];
        w->t0 = t0;
        w->t1 = clock_s(CLOCK_MONOTONIC);
        const long after = atomic_load(&n_releases);
        if (after > before)
            w->by = releases[(after - 1) % RELEASES];
        else
            memset(&w->by, 0, sizeof w->by);
    }
    return rc;
}

int pthread_mutex_unlock(pthread_mutex_t *m) {
    if (real_unlock == NULL)
        real_unlock = dlsym(RTLD_NEXT, "pthread_mutex_unlock");
    if (on && m == gil_mutex && m != NULL) {
        const long me = tid();
        if (me != training_tid) {
            const double now = clock_s(CLOCK_MONOTONIC);
            if (signalled) { /* the end of a drop: the stretch since the take */
                signalled = 0;
                const long i = holding ? atomic_fetch_add(&n_holds, 1) : HOLDS;
                if (i < HOLDS) {
                    hold_t *h = &holds[i];
                    h->tid = me;
                    h->t0 = took;
                    h->t1 = now;
                    h->cpu = clock_s(CLOCK_THREAD_CPUTIME_ID) - took_cpu;
                    h->take = took_at;
                    where(&h->drop);
                }
                holding = 0;
            } else { /* the end of a take */
                took = now;
                took_cpu = clock_s(CLOCK_THREAD_CPUTIME_ID);
                where(&took_at);
                holding = 1;
            }
        }
    }
    return real_unlock(m);
}

/* ---- called from Python (ctypes) ---- */

void gil_holds_start(void) {
    training_tid = tid();
    on = 1;
}

void gil_holds_stop(void) { on = 0; }

static void put_where(FILE *fp, const where_t *w) {
    for (int j = 0; j < FRAMES; ++j)
        fprintf(fp, "\t%s:%d", w->name[j], w->line[j]);
}

/* Background threads' waits for the GIL since the last call; clears the count. */
long gil_holds_background_waits(void) { return atomic_exchange(&n_background_waits, 0); }

/* Appends the waits and holds recorded since the last dump to two TSV files; clears them. */
int gil_holds_dump(const char *waits_path, const char *holds_path) {
    FILE *fw = fopen(waits_path, "a"), *fh = fopen(holds_path, "a");
    if (fw == NULL || fh == NULL)
        return -1;
    long n = atomic_exchange(&n_waits, 0);
    for (long i = 0; i < n && i < WAITS; ++i) {
        const wait_t *w = &waits[i];
        fprintf(fw, "%.6f\t%.1f\t%ld", w->t0, (w->t1 - w->t0) * 1e6, w->by.tid);
        put_where(fw, &w->by.at);
        fputc('\n', fw);
    }
    n = atomic_exchange(&n_holds, 0);
    for (long i = 0; i < n && i < HOLDS; ++i) {
        const hold_t *h = &holds[i];
        fprintf(fh, "%.6f\t%.1f\t%.1f\t%ld", h->t0, (h->t1 - h->t0) * 1e6, h->cpu * 1e6, h->tid);
        put_where(fh, &h->take);
        put_where(fh, &h->drop);
        fputc('\n', fh);
    }
    fclose(fw);
    fclose(fh);
    return 0;
}
