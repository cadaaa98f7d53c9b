/* shm's hot path in C: write a record, wait for one, read one, let one go (and tcp's one wait
 * that must not hold the GIL: polling a socket before its reader sleeps, rgpu_fd_spin).
 *
 * The same records as shm_ring.py describes, written and read by the same rules
 * as shm.py and shm_recv.py (which remain the reference, and the path for
 * everything these functions decline: records with heap buffers, a full ring,
 * anything malformed). Called through cffi, which releases the GIL for each
 * call: a waiting thread spins here without holding it. x86-64 only, like shm.
 */
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sched.h>
#include <unistd.h>
#include <immintrin.h>
#include <poll.h>

#include "rgpu_protocol.h"  /* rgpu/protocol: the frame's and the ring's numbers (generated) */

#define KIND_FRAME ((uint32_t)RGPU_SHM_KIND_FRAME)
#define KIND_WRAP ((uint32_t)RGPU_SHM_KIND_WRAP)
#define NO_SLOT ((uint32_t)RGPU_SHM_NO_SLOT)
#define REC_BYTES ((uint32_t)RGPU_SHM_RECORD_BYTES)       /* length, kind, slot, descriptors, blob length, blob in heap */
#define HEADER_BYTES ((uint32_t)RGPU_WIRE_HEADER_BYTES)   /* magic, version, kind, flags, seq, ack, meta length, buffers */
#define FAST_BUFS 8         /* a frame with more buffers goes the Python way */

typedef struct {
    volatile uint64_t *q;               /* the control words */
    uint8_t *ring_out, *ring_in;
    uint64_t ring_bytes, record_max, inline_max;
    uint32_t tail_out, head_out, asleep_out;    /* word indexes, ours to write into */
    uint32_t tail_in, head_in, waiting_in;      /* and the peer's */
    int data_out, space_in;             /* eventfds: "data for you", "space for you" */
    uint32_t magic, version;            /* the frame header's, as wire.py has them */
} rgpu_ring;

/* All words, so Python reads it with struct.unpack_from (FRAME_HEAD, FRAME_BUFS in shm_fast.py). */
typedef struct {
    uint64_t head;                      /* where the record starts (wrap markers skipped) */
    uint64_t next;                      /* the head once it is consumed */
    uint64_t seq, ack, kind, meta_len, nbufs;
    uint64_t meta_off;                  /* offsets into ring_in */
    uint64_t buf_off[FAST_BUFS], buf_len[FAST_BUFS];
    uint64_t tail;                      /* shm_native.c's serve: where our tail is */
} rgpu_frame;

static inline uint64_t load(volatile uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void signal_fd(int fd) {
    uint64_t one = 1;
    ssize_t n = write(fd, &one, sizeof one);    /* a full counter (never here) only delays a wake-up */
    (void)n;
}

static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* The tail moves after the record is written (x86 keeps stores in order; the release store keeps
 * the compiler from reordering); then a full fence before reading the peer's asleep flag. */
void rgpu_shm_publish(const rgpu_ring *r, uint64_t tail) {
    if (r->q[r->tail_out] == tail)
        return;
    __atomic_store_n(&r->q[r->tail_out], tail, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (r->q[r->asleep_out])
        signal_fd(r->data_out);
}

/* One frame wholly in the ring. Returns the new tail (published), -1 when the frame is not one for
 * the ring alone (too big, a buffer over inline_max, too many buffers), -2 when the ring has no room
 * now: the Python path does both (it waits for room). */
int64_t rgpu_shm_put(const rgpu_ring *r, uint64_t tail, uint32_t kind, uint32_t flags, uint64_t seq, uint64_t ack,
                     const char *meta, uint32_t meta_len, uint32_t nbufs, const char *const *bufs,
                     const uint64_t *lens) {
    if (nbufs > FAST_BUFS)
        return -1;
    uint64_t blob = HEADER_BYTES + 8ull * nbufs + meta_len;
    for (uint32_t i = 0; i < nbufs; i++) {
        if (lens[i] > r->inline_max)
            return -1;
        blob += lens[i];
    }
    uint64_t rec = (REC_BYTES + blob + 7) & ~7ull;
    if (rec > r->record_max)
        return -1;
    uint64_t pos = tail % r->ring_bytes;
    uint64_t wrap = pos + rec > r->ring_bytes ? r->ring_bytes - pos : 0;
    if (tail - load(&r->q[r->head_out]) + wrap + rec > r->ring_bytes)
        return -2;
    uint8_t *ring = r->ring_out;
    if (wrap) {
        put32(ring + pos, (uint32_t)wrap);
        put32(ring + pos + 4, KIND_WRAP);
        tail += wrap;
        pos = 0;
    }
    uint8_t *p = ring + pos;
    put32(p, (uint32_t)rec); put32(p + 4, KIND_FRAME); put32(p + 8, NO_SLOT);
    put32(p + 12, 0); put32(p + 16, (uint32_t)blob); put32(p + 20, 0);
    p += REC_BYTES;
    put32(p, r->magic);
    uint16_t version = (uint16_t)r->version, k = (uint16_t)kind;
    memcpy(p + 4, &version, 2); memcpy(p + 6, &k, 2);
    put32(p + 8, flags); put64(p + 12, seq); put64(p + 20, ack); put32(p + 28, meta_len); put32(p + 32, nbufs);
    p += HEADER_BYTES;
    for (uint32_t i = 0; i < nbufs; i++, p += 8)
        put64(p, lens[i]);
    memcpy(p, meta, meta_len);
    p += meta_len;
    for (uint32_t i = 0; i < nbufs; i++) {
        memcpy(p, bufs[i], lens[i]);
        p += lens[i];
    }
    tail += rec;
    rgpu_shm_publish(r, tail);
    return (int64_t)tail;
}

/* Until the peer's tail passes ``head``: spin (keeping the core until busy_s, yielding it after) up
 * to spin_s. 1: data came; 2: it came as a yield returned late (the peer most likely ran on our
 * core); 0: nothing came (the caller sleeps on the eventfd). */
int rgpu_shm_wait(const rgpu_ring *r, uint64_t head, double busy_s, double spin_s, int yield_core) {
    volatile uint64_t *tail = &r->q[r->tail_in];
    if (load(tail) != head)
        return 1;
    double start = now_s(), busy = start + busy_s, end = start + spin_s;
    for (;;) {
        for (int i = 0; i < 32; i++) {
            if (load(tail) != head)
                return 1;
            _mm_pause();
        }
        double t = now_s();
        if (t >= end)
            return load(tail) != head;
        if (t > busy && yield_core) {
            sched_yield();
            if (now_s() - t > 3e-6 && load(tail) != head)
                return 2;
        }
    }
}

/* Reads the record at ``head`` if it is a frame wholly in the ring with at most FAST_BUFS buffers
 * and every length adds up. 1: ``f`` describes it (not consumed yet); 0: no record there; 2: the
 * Python path reads it (``f->head`` is where, wrap markers skipped), naming whatever is wrong. */
int rgpu_shm_take(const rgpu_ring *r, uint64_t head, uint32_t max_meta, uint32_t max_bufs, uint64_t max_frame,
                  rgpu_frame *f) {
    const uint8_t *ring = r->ring_in;
    for (;;) {
        if (load(&r->q[r->tail_in]) == head)
            return 0;
        uint64_t pos = head % r->ring_bytes;
        uint32_t rec = get32(ring + pos), kind = get32(ring + pos + 4);
        if (kind == KIND_WRAP && pos + rec == r->ring_bytes) {
            head += rec;
            continue;
        }
        f->head = head;
        if (kind != KIND_FRAME || rec % 8 || rec < REC_BYTES || rec > r->record_max || pos + rec > r->ring_bytes)
            return 2;
        const uint8_t *p = ring + pos;
        uint32_t slot = get32(p + 8), ndesc = get32(p + 12), blob = get32(p + 16), in_heap = get32(p + 20);
        if (slot != NO_SLOT || ndesc || in_heap || REC_BYTES + (uint64_t)blob > rec || blob < HEADER_BYTES)
            return 2;
        p += REC_BYTES;
        uint16_t version, k;
        memcpy(&version, p + 4, 2); memcpy(&k, p + 6, 2);
        uint32_t flags = get32(p + 8), meta_len = get32(p + 28), nbufs = get32(p + 32);
        if (get32(p) != r->magic || version != r->version || flags || meta_len > max_meta || nbufs > max_bufs
            || nbufs > FAST_BUFS || HEADER_BYTES + 8ull * nbufs + meta_len > blob)
            return 2;
        uint64_t off = pos + REC_BYTES + HEADER_BYTES + 8ull * nbufs + meta_len, total = meta_len;
        for (uint32_t i = 0; i < nbufs; i++) {
            uint64_t n = get64(p + HEADER_BYTES + 8ull * i);
            if (n > blob) return 2;
            f->buf_off[i] = off;
            f->buf_len[i] = n;
            off += n;
            total += n;
        }
        if (off != pos + REC_BYTES + blob || total > max_frame)
            return 2;
        f->kind = k;
        f->seq = get64(p + 12);
        f->ack = get64(p + 20);
        f->meta_len = meta_len;
        f->nbufs = nbufs;
        f->meta_off = pos + REC_BYTES + HEADER_BYTES + 8ull * nbufs;
        f->next = head + rec;
        return 1;
    }
}

/* The records up to ``head`` are read: their ring space goes back to the peer (woken if it waits). */
void rgpu_shm_consume(const rgpu_ring *r, uint64_t head) {
    __atomic_store_n(&r->q[r->head_in], head, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (r->q[r->waiting_in])
        signal_fd(r->space_in);
}

/* tcp: poll ``fd`` for up to spin_s before its reader sleeps in recv (a reader asleep costs every
 * write to it a wake-up of its thread; GPU host, loopback). 1: something to read (or hung up, or an
 * error: the read that follows names it); 0: nothing within spin_s. */
int rgpu_fd_spin(int fd, double spin_s) {
    struct pollfd p = {fd, POLLIN, 0};
    double end = now_s() + spin_s;
    for (unsigned i = 0;; ++i) {
        if (poll(&p, 1, 0) != 0)
            return 1;
        if ((i & 7) == 7 && now_s() > end)
            return 0;
        _mm_pause();
    }
}

/* TLS: ``n`` bytes read through an OpenSSL ``SSL`` object, record after record, without the GIL.
 * Python's SSLSocket.recv_into returns one record (16 KiB at most) a call and takes the GIL again for
 * each, so a big frame read over TLS was 65,536 calls a GiB and several streams queued on the GIL
 * (tls_fast.py). ``read_ex`` is SSL_read_ex of the libssl Python's _ssl uses. Returns the bytes read:
 * fewer than n when SSL_read_ex would block or failed (the caller's recv_into then waits or raises). */
typedef int (*rgpu_ssl_read_ex)(void *ssl, void *buf, size_t num, size_t *readbytes);

uint64_t rgpu_tls_read(uintptr_t read_ex, uintptr_t ssl, char *buf, uint64_t n) {
    rgpu_ssl_read_ex read = (rgpu_ssl_read_ex)read_ex;
    uint64_t pos = 0;
    while (pos < n) {
        size_t got = 0;
        if (read((void *)ssl, buf + pos, (size_t)(n - pos), &got) != 1)
            break;
        pos += got;
    }
    return pos;
}
