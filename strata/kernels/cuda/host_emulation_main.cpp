// Host driver for the decoder check (appended after host_emulation.h, the generated tables
// and mmvq_decode.cuh): decode every chunk of the blocks in a file, write float32 weights
// (code + IOFF) * scale + min, in weight order, to stdout (exit 4: a RAW decode disagreed).
// usage: prog TYPE_ID N_BLOCKS FILE
// Types with a raw form (RAWF in mmvq_decode.cuh) also decode RAW, as the MMVQ kernels take
// them: every raw code times the raw scale must equal the plain decode's value, else exit 4.
template <int ID> static bool raw_matches(const u8* blk, int c, const Chunk& r) {
    typedef TypeOf<ID> T;
    if constexpr (T::RAWF == RAW_NONE) return true;
    Chunk raw;
    raw.mn[0] = raw.mn[1] = 0;
    T::template decode<1, true>(blk, c, raw, T::table());
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 4; j++) {
            const int h = i / 4, code = (i8)((r.q[i] >> (8 * j)) & 0xFF);
            if (r.sc[h] * (float)code != raw.sc[h] * (float)raw_code<T::RAWF>(raw, i, j) || r.mn[h] != raw.mn[h])
                return false;
        }
    return true;
}

template <int ID> static void run(const u8* data, int nblk, float* out) {
    typedef TypeOf<ID> T;
    for (int b = 0; b < nblk; b++)
        for (int c = 0; c < T::BS / 32; c++) {
            Chunk r;
            r.mn[0] = r.mn[1] = 0;
            T::decode(data + (size_t)b * T::TS, c, r, T::table());
            if (!raw_matches<ID>(data + (size_t)b * T::TS, c, r)) exit(4);
            for (int i = 0; i < 8; i++)
                for (int j = 0; j < 4; j++) {
                    const int code = (i8)((r.q[i] >> (8 * j)) & 0xFF), h = i / 4;
                    const int w = code_weight(T::ORDER, i, j);
                    out[(size_t)b * T::BS + 32 * c + w] = r.sc[h] * (float)(code + T::IOFF) + (T::MIN ? r.mn[h] : 0.f);
                }
        }
    fwrite(out, sizeof(float), (size_t)nblk * T::BS, stdout);
}

int main(int argc, char** argv) {
    if (argc != 4) return 2;
    const int id = atoi(argv[1]), nblk = atoi(argv[2]);
    FILE* f = fopen(argv[3], "rb");
    if (!f) return 2;
    fseek(f, 0, SEEK_END);
    const long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    u8* d = (u8*)aligned_alloc(16, (n + 31) / 16 * 16);
    if (fread(d, 1, n, f) != (size_t)n) return 2;
    fclose(f);
    float* out = (float*)malloc(sizeof(float) * (size_t)nblk * 256);
    switch (id) {
#define C(X) case X: run<X>(d, nblk, out); break;
        C(2) C(3) C(6) C(7) C(8) C(10) C(11) C(12) C(13) C(14) C(16) C(17) C(18) C(19) C(20) C(21) C(22) C(23)
        C(29) C(34) C(35) C(39) C(40) C(41) C(42)
        default: return 3;
    }
    return 0;
}
