/* The KV handoff checksum "kvsum64x256k", a copy and a gather that compute it as the bytes pass through, and
 * the scatter that puts imported bytes into an engine's paged cache.
 *
 * qwenserve/kv_transfer/checksum.py defines the algorithm and holds a NumPy reference that must give the same
 * digests (tested); in short, per chunk of up to 256 KiB, read as 64-byte stripes of eight little-endian
 * 64-bit words w[s][0..7]:
 *     key[s][j] = KEY0[j] + s * KEY_STEP
 *     d         = w[s][j] ^ key[s][j]
 *     acc[j]   += lo32(d) * hi32(d) + w[s][j ^ 1]          (mod 2^64; acc starts at ACC0[j])
 * a last partial stripe is padded with zeros; the chunk's digest folds its length and the eight lanes through
 * a bijective mixer, and the handoff's checksum folds its total length and every chunk digest in order.
 * Any one changed word changes lane j ^ 1 by exactly its difference, so it is always detected; keys that
 * change with every stripe make moved stripes count too.
 *
 * The inner loop is a load, an xor, a shift, a 32x32->64 multiply and two adds per 64 bytes: far faster than
 * memory, so hashing costs nothing beyond reading the bytes, and a copy that hashes what it moves costs what
 * the copy costs. Large copies store with non-temporal writes: the bytes are for another process, and
 * streaming them past the cache skips reading each destination line before it is overwritten. */
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

static const uint64_t KEY0[8] = {
    0x9e3779b97f4a7c15ULL, 0xbf58476d1ce4e5b9ULL, 0x94d049bb133111ebULL, 0x2545f4914f6cdd1dULL,
    0x5851f42d4c957f2dULL, 0x14057b7ef767814fULL, 0xd6e8feb86659fd93ULL, 0xa0761d6478bd642fULL,
};
static const uint64_t ACC0[8] = {1, 2, 3, 4, 5, 6, 7, 8};
/* Reads ask for the line this far ahead: one core alone cannot keep enough misses in flight to read memory at
 * its rate, and the hardware prefetcher alone reaches too short a way (bench/handoff_bench.py measures the
 * rates). Prefetches never fault, so running past the end is harmless. */
#define PREFETCH_BYTES 8192
#define KEY_STEP 0xe7037ed1a0b428dbULL
#define LENGTH_SEED 0x8ebc6af09c88c6e3ULL

static inline uint64_t mix64(uint64_t h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

static inline void stripe_scalar(uint64_t acc[8], uint64_t key[8], const uint64_t w[8]) {
    for (int j = 0; j < 8; j++) {
        const uint64_t d = w[j] ^ key[j];
        acc[j] += (d & 0xffffffffULL) * (d >> 32) + w[j ^ 1];
        key[j] += KEY_STEP;
    }
}

/* The whole stripes of one chunk; `store`: 0 none, 1 ordinary, 2 non-temporal (dst 64-byte aligned). Lines
 * are prefetched while they lie before src + `readable` (a gather's piece ends where its source does). */
static inline __attribute__((always_inline)) void stripes(const uint8_t *src, uint8_t *dst, int64_t full,
                                                          uint64_t acc[8], uint64_t key[8], const int store,
                                                          const int64_t readable) {
#if defined(__AVX512F__)
    __m512i a = _mm512_loadu_si512(acc), k = _mm512_loadu_si512(key);
    const __m512i step = _mm512_set1_epi64((long long)KEY_STEP);
    for (int64_t i = 0; i < full; i += 64) {
        if (i + PREFETCH_BYTES < readable) _mm_prefetch((const char *)(src + i + PREFETCH_BYTES), _MM_HINT_T0);
        const __m512i v = _mm512_loadu_si512(src + i);
        if (store == 1) _mm512_storeu_si512(dst + i, v);
        if (store == 2) _mm512_stream_si512((void *)(dst + i), v);
        const __m512i d = _mm512_xor_si512(v, k);
        k = _mm512_add_epi64(k, step);
        a = _mm512_add_epi64(a, _mm512_mul_epu32(d, _mm512_srli_epi64(d, 32)));
        a = _mm512_add_epi64(a, _mm512_shuffle_epi32(v, _MM_PERM_BADC)); /* lane j gets word j ^ 1 */
    }
    _mm512_storeu_si512(acc, a);
    _mm512_storeu_si512(key, k);
#elif defined(__AVX2__)
    __m256i a0 = _mm256_loadu_si256((const __m256i *)acc), a1 = _mm256_loadu_si256((const __m256i *)(acc + 4));
    __m256i k0 = _mm256_loadu_si256((const __m256i *)key), k1 = _mm256_loadu_si256((const __m256i *)(key + 4));
    const __m256i step = _mm256_set1_epi64x((long long)KEY_STEP);
    for (int64_t i = 0; i < full; i += 64) {
        if (i + PREFETCH_BYTES < readable) _mm_prefetch((const char *)(src + i + PREFETCH_BYTES), _MM_HINT_T0);
        const __m256i v0 = _mm256_loadu_si256((const __m256i *)(src + i));
        const __m256i v1 = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        if (store == 1) {
            _mm256_storeu_si256((__m256i *)(dst + i), v0);
            _mm256_storeu_si256((__m256i *)(dst + i + 32), v1);
        }
        if (store == 2) {
            _mm256_stream_si256((__m256i *)(dst + i), v0);
            _mm256_stream_si256((__m256i *)(dst + i + 32), v1);
        }
        const __m256i d0 = _mm256_xor_si256(v0, k0), d1 = _mm256_xor_si256(v1, k1);
        k0 = _mm256_add_epi64(k0, step);
        k1 = _mm256_add_epi64(k1, step);
        a0 = _mm256_add_epi64(a0, _mm256_mul_epu32(d0, _mm256_srli_epi64(d0, 32)));
        a1 = _mm256_add_epi64(a1, _mm256_mul_epu32(d1, _mm256_srli_epi64(d1, 32)));
        a0 = _mm256_add_epi64(a0, _mm256_shuffle_epi32(v0, 0x4e)); /* swaps the 64-bit words of each pair */
        a1 = _mm256_add_epi64(a1, _mm256_shuffle_epi32(v1, 0x4e));
    }
    _mm256_storeu_si256((__m256i *)acc, a0);
    _mm256_storeu_si256((__m256i *)(acc + 4), a1);
    _mm256_storeu_si256((__m256i *)key, k0);
    _mm256_storeu_si256((__m256i *)(key + 4), k1);
#else
    (void)store;
    (void)readable;
    uint64_t w[8];
    for (int64_t i = 0; i < full; i += 64) {
        memcpy(w, src + i, 64); /* little-endian hosts: the words are the bytes' little-endian reading */
        if (dst) memcpy(dst + i, w, 64);
        stripe_scalar(acc, key, w);
    }
#endif
}

static inline uint64_t finish_digest(const uint64_t acc[8], int64_t n) {
    uint64_t h = (uint64_t)n ^ LENGTH_SEED;
    for (int j = 0; j < 8; j++) h = mix64(h ^ acc[j]);
    return h;
}

static uint64_t chunk_digest(const uint8_t *src, uint8_t *dst, int64_t n, int stream) {
    uint64_t acc[8], key[8];
    memcpy(acc, ACC0, sizeof acc);
    memcpy(key, KEY0, sizeof key);
    const int64_t full = n & ~(int64_t)63;
    const int64_t readable = full + PREFETCH_BYTES; /* the next chunk follows: read on */
    if (!dst)
        stripes(src, dst, full, acc, key, 0, readable);
    else if (stream && ((uintptr_t)dst & 63) == 0)
        stripes(src, dst, full, acc, key, 2, readable);
    else
        stripes(src, dst, full, acc, key, 1, readable);
    if (n > full) {
        uint64_t w[8] = {0};
        memcpy(w, src + full, (size_t)(n - full));
        if (dst) memcpy(dst + full, src + full, (size_t)(n - full));
        stripe_scalar(acc, key, w);
    }
    return finish_digest(acc, n);
}

/* The digests of consecutive `chunk`-byte chunks of src[0, nbytes) (the last may be short) into digests[];
 * with dst, the bytes are copied there as they are hashed (non-temporally where `stream` and aligned). Each of
 * `num_threads` threads takes one contiguous run of chunks, so every core reads sequentially. */
void kv_checksum_chunks(const uint8_t *src, uint8_t *dst, int64_t nbytes, int64_t chunk, uint64_t *digests,
                        int64_t stream, int64_t num_threads) {
    const int64_t count = (nbytes + chunk - 1) / chunk;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && count > 1)
    for (int64_t c = 0; c < count; c++) {
        const int64_t start = c * chunk, n = nbytes - start < chunk ? nbytes - start : chunk;
        digests[c] = chunk_digest(src + start, dst ? dst + start : NULL, n, (int)stream);
    }
#if defined(__SSE2__)
    /* Non-temporal stores are weakly ordered: make them visible before the caller announces the bytes. */
    if (dst && stream) _mm_sfence();
#endif
}

/* Where stream byte `pos` of a gather comes from, and how many bytes from there on are contiguous in src
 * (rows adjacent in src run on), up to stream byte `end`. */
static inline int64_t gather_piece(const uint8_t *src, int64_t plane_bytes, int64_t plane_stride, const int64_t *rows,
                                   int64_t num_rows, int64_t row_bytes, int64_t pos, int64_t end,
                                   const uint8_t **from) {
    const int64_t p = pos / plane_bytes, within = pos - p * plane_bytes;
    int64_t t = within / row_bytes;
    const int64_t off = within - t * row_bytes;
    *from = src + p * plane_stride + rows[t] * row_bytes + off;
    int64_t piece = row_bytes - off;
    while (pos + piece < end && t + 1 < num_rows && rows[t + 1] == rows[t] + 1) {
        t++;
        piece += row_bytes;
    }
    return pos + piece > end ? end - pos : piece;
}

/* A gather that hashes what it writes: dst, read as one stream of `planes` planes of `num_rows` rows of
 * `row_bytes` each, gets row t of plane p from src + p * plane_stride + rows[t] * row_bytes (the engine's paged
 * cache seen as [layers * 2, slots, heads * head_dim]), and digests[] the kvsum digests of the stream's
 * `chunk`-byte chunks, exactly as kv_checksum_chunks would give for dst afterwards. Rows adjacent in src move
 * as one piece, and the next piece's first lines are asked for while this one moves (the hardware prefetcher
 * cannot guess a jump). With whole stripes (row_bytes a multiple of 64, dst 64-byte aligned) each piece is
 * hashed as it is copied, non-temporally where `stream`; otherwise a chunk is gathered, then hashed while in
 * cache. */
void kv_gather_checksum(const uint8_t *src, int64_t planes, int64_t plane_stride, const int64_t *rows,
                        int64_t num_rows, int64_t row_bytes, uint8_t *dst, int64_t chunk, uint64_t *digests,
                        int64_t stream, int64_t num_threads) {
    const int64_t plane_bytes = num_rows * row_bytes, total = planes * plane_bytes;
    const int64_t count = (total + chunk - 1) / chunk;
    const int whole = row_bytes % 64 == 0 && ((uintptr_t)dst & 63) == 0 && chunk % 64 == 0;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && count > 1)
    for (int64_t c = 0; c < count; c++) {
        const int64_t start = c * chunk, end = total - start < chunk ? total : start + chunk;
        uint64_t acc[8], key[8];
        memcpy(acc, ACC0, sizeof acc);
        memcpy(key, KEY0, sizeof key);
        const uint8_t *from;
        int64_t piece = gather_piece(src, plane_bytes, plane_stride, rows, num_rows, row_bytes, start, end, &from);
        for (int64_t pos = start; pos < end;) {
            const uint8_t *next = NULL;
            int64_t next_piece = 0;
            if (pos + piece < total) {
                next_piece = gather_piece(src, plane_bytes, plane_stride, rows, num_rows, row_bytes, pos + piece,
                                          pos + piece < end ? end : total, &next);
#if defined(__SSE__) || defined(__x86_64__)
                const int64_t ahead = next_piece < PREFETCH_BYTES ? next_piece : PREFETCH_BYTES;
                for (int64_t i = 0; i < ahead; i += 64) _mm_prefetch((const char *)(next + i), _MM_HINT_T0);
#endif
            }
            if (!whole)
                memcpy(dst + pos, from, (size_t)piece);
            else if (stream)
                stripes(from, dst + pos, piece, acc, key, 2, piece);
            else
                stripes(from, dst + pos, piece, acc, key, 1, piece);
            pos += piece;
            from = next;
            piece = next_piece;
        }
        digests[c] = whole ? finish_digest(acc, end - start) : chunk_digest(dst + start, NULL, end - start, 0);
    }
#if defined(__SSE2__)
    if (stream) _mm_sfence();
#endif
}

/* The gather's mirror, for an import (already verified, so nothing to hash): row t of plane p of src (at
 * src + p * src_plane_stride + t * row_bytes) goes to dst + p * dst_plane_stride + rows[t] * row_bytes. Rows
 * adjacent in dst move as one piece; each thread takes whole planes. */
void kv_scatter_rows(const uint8_t *src, int64_t src_plane_stride, uint8_t *dst, int64_t dst_plane_stride,
                     int64_t planes, const int64_t *rows, int64_t num_rows, int64_t row_bytes, int64_t num_threads) {
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && planes > 1)
    for (int64_t p = 0; p < planes; p++) {
        const uint8_t *from = src + p * src_plane_stride;
        uint8_t *to = dst + p * dst_plane_stride;
        for (int64_t t = 0; t < num_rows;) {
            int64_t run = 1;
            while (t + run < num_rows && rows[t + run] == rows[t] + run) run++;
            memcpy(to + rows[t] * row_bytes, from + t * row_bytes, (size_t)(run * row_bytes));
            t += run;
        }
    }
}

/* The handoff's checksum from its total length and its chunk digests in order. */
uint64_t kv_checksum_combine(const uint64_t *digests, int64_t count, int64_t nbytes) {
    uint64_t h = (uint64_t)nbytes ^ LENGTH_SEED;
    for (int64_t c = 0; c < count; c++) h = mix64(h ^ digests[c]);
    return h;
}
