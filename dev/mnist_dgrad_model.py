#!/usr/bin/env python3
"""A CPU model of train_mnist.cu's conv2_dgrad_tf32_kernel: its index expressions transcribed per lane and warp (the
patch with shared zero padding, the wgmma descriptors as the hardware reads them, or the mma.sync fragments, the
exchange of a warp's last rows, the shuffle combine of the three kx taps, the channel transpose and conv1's sums),
run on random inputs and compared with a direct computation of dact1 and conv1's gradient. float64 without TF32
rounding: it checks the data movement, not the numerics; unwritten shared memory is NaN, so a read of it fails.
Not part of `make test` (it checks a transcription, not the kernel: dev/test_mnist does that on a GPU); run it after
changing the kernel's layout, before a GPU round:  python3 dev/mnist_dgrad_model.py [B,grid,wgmma|mma ...]"""
import sys
import numpy as np

C1, C2, H1, H2, HP, IMG = 32, 64, 26, 24, 12, 28
DG_CW = 8; DG_CT = 256; DG_THREADS = 288
DG_CH, DG_TM = 336, 62
DG_TILES = (DG_CH + DG_TM - 1) // DG_TM
DG_N = 3 * C1
DG_NS = (DG_TILES - 1) * DG_TM + 64 + 2 * H1
DG_PL = DG_NS | 1
DG_WS = 9 * C1 * C2; DG_PS = C2 * DG_PL; DG_XROWS = 18; DG_XS = DG_XROWS * IMG; DG_EX = 2 * 2 * 4 * 96
POOL_NO_GRAD = 255


def make_inputs(B, rng):
    w2 = rng.standard_normal((C2, 9, C1))                       # [co][tap][ci]
    dpooled = rng.standard_normal((B, HP, HP, C2))
    codes = rng.integers(0, 4, (B, HP, HP, C2)).astype(np.uint8)
    codes[rng.random(codes.shape) < 0.1] = POOL_NO_GRAD
    act1 = rng.standard_normal((B, H1, H1, C1))
    x = rng.standard_normal((B, IMG, IMG))
    return w2, dpooled, codes, act1, x


def reference(B, w2, dpooled, codes, act1, x):
    dact2 = np.zeros((B, H2, H2, C2))
    for y in range(H2):
        for xx in range(H2):
            c = codes[:, y // 2, xx // 2, :]
            dact2[:, y, xx, :] = np.where(c == (y % 2) * 2 + xx % 2, dpooled[:, y // 2, xx // 2, :], 0.0)
    d2p = np.zeros((B, IMG, IMG, C2)); d2p[:, 2:26, 2:26, :] = dact2
    dact1 = np.zeros((B, H1, H1, C1))
    for ky in range(3):
        for kx in range(3):
            W = w2[:, 8 - (3 * ky + kx), :]                      # [c][n]
            dact1 += np.einsum('byxc,cn->byxn', d2p[:, ky:ky + H1, kx:kx + H1, :], W)
    dact1 = np.where(act1 > 0, dact1, 0.0)
    dw1 = np.zeros((C1, 9)); db1 = dact1.sum(axis=(0, 1, 2))
    for k in range(9):
        dw1[:, k] = np.einsum('byxn,byx->n', dact1, x[:, k // 3:k // 3 + H1, k % 3:k % 3 + H1])
    return dact1, dw1, db1


def forward_wimg(w2):
    """The forward's write_wimg: wimg_dgrad[(((td/3*(COUT/4) + co/4)*3 + td%3)*CIN + ci)*4 + co%4] = Ws[tap][co][ci]."""
    img = np.full(DG_WS, np.nan)
    COUT, CIN = C2, C1
    for co in range(COUT):
        for tap in range(9):
            for ci in range(CIN):
                td = 8 - tap
                img[((((td // 3) * (COUT // 4) + co // 4) * 3 + td % 3) * CIN + ci) * 4 + co % 4] = w2[co, tap, ci]
    assert not np.isnan(img).any()
    return img


def dact2_expand(d, k, y, x):
    me = ((y & 1) << 1) | (x & 1)
    return np.where(k == me, d, 0.0)


def xrow(q):
    return (q // (H1 * H1)) * IMG + (q % (H1 * H1)) // H1


def desc_read(smem, start_f, lbo_b, sbo_b, rows):
    """What a K-major no-swizzle descriptor reads for one k8 step: rows x 8 (core matrix (i, j) at start + i SBO +
    j LBO; row r of it at + 16 r bytes; element k % 4 at + 4 (k % 4))."""
    out = np.zeros((rows, 8))
    for r in range(rows):
        for k in range(8):
            a = start_f * 4 + (r // 8) * sbo_b + (k // 4) * lbo_b + (r % 8) * 16 + (k % 4) * 4
            assert a % 4 == 0
            out[r, k] = smem[a // 4]
    return out


def run(B, grid, path, rng):
    w2, dpooled, codes, act1, x = make_inputs(B, rng)
    dact1_ref, dw1_ref, db1_ref = reference(B, w2, dpooled, codes, act1, x)
    wimg = forward_wimg(w2)
    dpf, cdf, a1f, xf = dpooled.ravel(), codes.ravel(), act1.ravel(), x.ravel()
    total = B * H1 * H1; nchunks = (total + DG_CH - 1) // DG_CH
    dact1 = np.full(total * C1, np.nan)
    w1_partial = np.zeros((grid, C1 * 10))
    for blk in range(grid):
        smem = np.full(DG_WS + DG_PS + DG_XS + DG_CH + DG_EX, np.nan)
        Ws, Ps, Xs, Ms_off, Ex = 0, DG_WS, DG_WS + DG_PS, DG_WS + DG_PS + DG_XS, DG_WS + DG_PS + DG_XS + DG_CH
        Ms = np.zeros(DG_CH, dtype=np.uint64)
        smem[Ws:Ws + DG_WS] = wimg
        # w1acc[warp][lane][ii][e][k]
        w1acc = np.zeros((DG_CW, 32, 2, 2, 10))
        parity = np.zeros(2, dtype=int)  # per warpgroup (all its warps alike)
        for chunk in range(blk, nchunks, grid):
            q0 = chunk * DG_CH; npix = min(DG_CH, total - q0); xs_lo = xrow(q0); nx = xrow(q0 + npix - 1) + 3 - xs_lo
            # prepare: padding
            smem[Ps:Ps + DG_PS] = np.nan  # stale data: anything not written below must not be read
            for i in range(DG_NS * (C2 // 4)):
                s, c4 = i // (C2 // 4), i % (C2 // 4); L = q0 + s; r = L % (H1 * H1)
                if L >= total or r < 2 * H1 or r % H1 < 2:
                    smem[Ps + (c4 * DG_PL + s) * 4:Ps + (c4 * DG_PL + s) * 4 + 4] = 0.0
            assert nx <= DG_XROWS
            smem[Xs:Xs + DG_XS] = np.nan
            smem[Xs:Xs + nx * IMG] = xf[xs_lo * IMG:xs_lo * IMG + nx * IMG]
            # act1's signs: the forward's words (bit n: act1[.., n] > 0), loaded per pixel
            Ms[:] = 0xDEADBEEF
            for p in range(npix):
                Ms[p] = sum(1 << n for n in range(C1) if a1f[(q0 + p) * C1 + n] > 0)
            # fill
            def pooled_row(L, last):
                b = L // (H1 * H1); py = (L % (H1 * H1)) // H1
                return b * HP - (1 if last else 0) if py < 2 else b * HP + (py - 2) // 2
            tp_lo = pooled_row(q0, False); ntp = min(pooled_row(q0 + DG_NS - 1, True), B * HP - 1) + 1 - tp_lo
            npc = ntp * HP * (C2 // 4)
            for i in range(npc):
                pi = (tp_lo * HP + i // (C2 // 4)) * C2 + (i % (C2 // 4)) * 4
                dv = dpf[pi:pi + 4]; kv = cdf[pi:pi + 4].astype(int)
                tp = tp_lo + i // (HP * (C2 // 4)); pc = (i // (C2 // 4)) % HP; c4 = i % (C2 // 4)
                s0 = (tp // HP) * (H1 * H1) + (2 * (tp % HP) + 2) * H1 + 2 * pc + 2 - q0
                for dy in range(2):
                    for dx in range(2):
                        s = s0 + dy * H1 + dx
                        if 0 <= s < DG_NS:
                            smem[Ps + (c4 * DG_PL + s) * 4:Ps + (c4 * DG_PL + s) * 4 + 4] = dact2_expand(dv, kv, dy, dx)
            ntiles = (npix + DG_TM - 1) // DG_TM
            # the two warpgroups' tiles, in an interleaved order (tile order must not matter)
            for tile in range(ntiles):
                wg = tile % 2
                # d[wq][lane][48]
                d = np.zeros((4, 32, 48))
                if path == 'wgmma':
                    D = np.zeros((64, 96))
                    for ky in range(3):
                        for ks in range(C2 // 8):
                            # da0 + (2 ks PL + ky H1) units of 16 bytes; db0 + (ky (C2/4) + 2 ks) DG_N units
                            a_start = Ps + tile * DG_TM * 4 + (2 * ks * DG_PL + ky * H1) * 4
                            b_start = Ws + ((ky * (C2 // 4) + 2 * ks) * DG_N) * 4
                            A = desc_read(smem, a_start, DG_PL * 16, 128, 64)
                            Bm = desc_read(smem, b_start, DG_N * 16, 128, 96)
                            assert not np.isnan(A).any() and not np.isnan(Bm).any(), (chunk, tile, ky, ks)
                            D += A @ Bm.T
                    for wq in range(4):
                        for ln in range(32):
                            g, t = ln >> 2, ln & 3
                            for i in range(12):
                                for h in range(2):
                                    for e in range(2):
                                        d[wq, ln, 4 * i + 2 * h + e] = D[16 * wq + g + 8 * h, 8 * i + 2 * t + e]
                else:
                    for wq in range(4):
                        for ln in range(32):
                            g, t = ln >> 2, ln & 3
                            for ky in range(3):
                                for ks in range(C2 // 8):
                                    pa = Ps + (2 * ks * DG_PL + tile * DG_TM + ky * H1 + 16 * wq + g) * 4 + t
                                    pb = Ws + ((ky * (C2 // 4) + 2 * ks) * DG_N + g) * 4 + t
                                    # this lane's fragments; the mma is emulated per warp below
                            # done per warp
                        # per warp mma: A rows (g, g+8), k (t, t+4) from all lanes; B (k t, t+4; n g) per n8 tile
                        for ky in range(3):
                            for ks in range(C2 // 8):
                                A = np.zeros((16, 8)); Bt = np.zeros((12, 8, 8))  # Bt[i][n][k]
                                for ln in range(32):
                                    g, t = ln >> 2, ln & 3
                                    pa = Ps + (2 * ks * DG_PL + tile * DG_TM + ky * H1 + 16 * wq + g) * 4 + t
                                    A[g, t] = smem[pa]; A[g + 8, t] = smem[pa + 32]
                                    A[g, t + 4] = smem[pa + DG_PL * 4]; A[g + 8, t + 4] = smem[pa + DG_PL * 4 + 32]
                                    pb = Ws + ((ky * (C2 // 4) + 2 * ks) * DG_N + g) * 4 + t
                                    for i in range(12):
                                        Bt[i, g, t] = smem[pb + 32 * i]; Bt[i, g, t + 4] = smem[pb + DG_N * 4 + 32 * i]
                                assert not np.isnan(A).any() and not np.isnan(Bt).any()
                                for i in range(12):
                                    C = A @ Bt[i].T  # 16 x 8
                                    for ln in range(32):
                                        g, t = ln >> 2, ln & 3
                                        for h in range(2):
                                            for e in range(2):
                                                d[wq, ln, 4 * i + 2 * h + e] += C[g + 8 * h, 2 * t + e]
                # exchange
                par = parity[wg]
                exb = Ex + (par * 2 + wg) * 4 * 96
                smem[exb:exb + 4 * 96] = np.nan
                for wq in range(4):
                    for ln in range(32):
                        g, t = ln >> 2, ln & 3
                        if wq > 0 and g < 2:
                            for j in range(8):
                                if g == 0:
                                    smem[exb + (wq - 1) * 96 + t * 8 + j] = d[wq, ln, 16 + 4 * (j // 2) + j % 2]
                                smem[exb + (wq - 1) * 96 + 32 + (g * 4 + t) * 8 + j] = d[wq, ln, 32 + 4 * (j // 2) + j % 2]
                # combine (per warp: shuffles read the pre-combine values)
                for wq in range(4):
                    dd = d[wq].copy()
                    x1 = exb + wq * 96; x2 = exb + wq * 96 + 32; nxt = wq < 3
                    for ln in range(32):
                        g, t = ln >> 2, ln & 3
                        src1 = ((g + 1) & 7) * 4 + t; src2 = ((g + 2) & 7) * 4 + t
                        for i in range(4):
                            for e in range(2):
                                def provide1_0(l):
                                    gg = l >> 2
                                    return dd[l, 16 + 4 * i + 2 + e] if gg == 0 else dd[l, 16 + 4 * i + e]
                                def provide1_1(l):
                                    gg, tt = l >> 2, l & 3
                                    if gg == 0:
                                        v = smem[x1 + tt * 8 + 2 * i + e] if nxt else 0.0
                                        return v
                                    return dd[l, 16 + 4 * i + 2 + e]
                                def provide2_0(l):
                                    gg = l >> 2
                                    return dd[l, 32 + 4 * i + 2 + e] if gg < 2 else dd[l, 32 + 4 * i + e]
                                def provide2_1(l):
                                    gg, tt = l >> 2, l & 3
                                    if gg < 2:
                                        return smem[x2 + (gg * 4 + tt) * 8 + 2 * i + e] if nxt else 0.0
                                    return dd[l, 32 + 4 * i + 2 + e]
                                s10, s11, s20, s21 = provide1_0(src1), provide1_1(src1), provide2_0(src2), provide2_1(src2)
                                d[wq, ln, 4 * i + e] = (dd[ln, 4 * i + e] + s10) + s20
                                d[wq, ln, 4 * i + 2 + e] = (dd[ln, 4 * i + 2 + e] + s11) + s21
                    # transpose + epilogue
                    o = np.zeros((32, 2, 2, 2, 2))
                    for ln in range(32):
                        g = ln >> 2
                        for h in range(2):
                            for ii in range(2):
                                for e in range(2):
                                    lo, hi = d[wq, ln, 4 * ii + 2 * h + e], d[wq, ln, 4 * (2 + ii) + 2 * h + e]
                                    o[ln, 0, h, ii, e] = hi if g & 1 else lo
                                    partner = ln ^ 4; gp = partner >> 2
                                    plo, phi = d[wq, partner, 4 * ii + 2 * h + e], d[wq, partner, 4 * (2 + ii) + 2 * h + e]
                                    o[ln, 1, h, ii, e] = plo if gp & 1 else phi  # partner's give
                    warp = wg * 4 + wq
                    for ln in range(32):
                        g, t = ln >> 2, ln & 3
                        for j in range(2):
                            for h in range(2):
                                r = 16 * wq + (g ^ j) + 8 * h; m = tile * DG_TM + r; q = q0 + m
                                ok = r < DG_TM and m < npix
                                mask = int(Ms[m]) if ok else 0
                                xs = Xs + (xrow(q) - xs_lo) * IMG + q % H1
                                xv = [smem[xs + (k // 3) * IMG + k % 3] if ok else 0.0 for k in range(9)]
                                assert not np.isnan(xv).any()
                                for ii in range(2):
                                    n0 = 8 * (2 * (g & 1) + ii) + 2 * t
                                    v = [0.0, 0.0]
                                    for e in range(2):
                                        n = n0 + e
                                        v[e] = o[ln, j, h, ii, e] if (mask >> n) & 1 else 0.0
                                        if ok:
                                            assert not np.isnan(v[e])
                                        w1acc[warp, ln, ii, e, 9] += v[e]
                                        for k in range(9):
                                            w1acc[warp, ln, ii, e, k] += v[e] * xv[k]
                                    if ok:
                                        dact1[q * C1 + n0:q * C1 + n0 + 2] = v
                parity[wg] ^= 1
        # reduction
        red = np.zeros((DG_CW, C1 * 10))
        for warp in range(DG_CW):
            v20 = np.zeros((32, 20)); v10 = np.zeros((32, 10))
            for ln in range(32):
                for i in range(20):
                    up = ln & 16
                    lo, hi = w1acc[warp, ln, 0, i // 10, i % 10], w1acc[warp, ln, 1, i // 10, i % 10]
                    p = ln ^ 16
                    plo, phi = w1acc[warp, p, 0, i // 10, i % 10], w1acc[warp, p, 1, i // 10, i % 10]
                    v20[ln, i] = (hi if up else lo) + (phi if up else plo)  # the partner sends what this lane keeps
            for ln in range(32):
                for i in range(10):
                    up = ln & 8; p = ln ^ 8
                    v10[ln, i] = (v20[ln, 10 + i] if up else v20[ln, i]) + (v20[p, 10 + i] if up else v20[p, i])
            for ln in range(32):
                g, t = ln >> 2, ln & 3
                c = 8 * (2 * (g & 1) + (g >> 2)) + 2 * t + ((g >> 1) & 1)
                red[warp, c * 10:c * 10 + 10] = v10[ln]
        for qq in range(C1 * 10):
            c, k = qq // 10, qq % 10
            w1_partial[blk, (c * 9 + k) if k < 9 else C1 * 9 + c] = red[:, qq].sum()
    dact1 = dact1.reshape(B, H1, H1, C1)
    assert not np.isnan(dact1).any(), "pixels not stored"
    tot = w1_partial.sum(axis=0)
    e1 = np.abs(dact1 - dact1_ref).max(); e2 = np.abs(tot[:C1 * 9].reshape(C1, 9) - dw1_ref).max(); e3 = np.abs(tot[C1 * 9:] - db1_ref).max()
    print(f"B={B} grid={grid} {path}: max |dact1 err| {e1:.3e}, |dw1 err| {e2:.3e}, |db1 err| {e3:.3e} (scale {np.abs(dact1_ref).max():.2f})")
    return max(e1, e2, e3) < 1e-9


if __name__ == "__main__":
    rng = np.random.default_rng(1)
    ok = True
    cases = [(1, 2, 'wgmma'), (3, 4, 'wgmma'), (3, 3, 'mma')]
    if len(sys.argv) > 1:
        if sys.argv[1] in ("-h", "--help"):
            print(__doc__)
            sys.exit(0)
        try:
            cases = [(int(a.split(',')[0]), int(a.split(',')[1]), a.split(',')[2]) for a in sys.argv[1:]]
        except (ValueError, IndexError):
            sys.exit(f"error: expected cases B,grid,wgmma|mma (e.g. 3,4,wgmma), found {' '.join(sys.argv[1:])}")
        if any(B < 1 or grid < 1 or path not in ("wgmma", "mma") for B, grid, path in cases):
            sys.exit(f"error: expected cases B,grid,wgmma|mma with B, grid >= 1, found {' '.join(sys.argv[1:])}")
    for B, grid, path in cases:
        ok &= run(B, grid, path, rng)
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)
