/*
Timeline of train_mnist.cu's training step inside its CUDA graphs: when each fast-path kernel's warps start, when
their grid_dep_sync returns (the kernel in front is complete) and when they leave, on the GPU's global timer. ncu
times kernels one at a time; this shows what programmatic dependent launch overlaps and where a step waits.

Build: make -C dev trace_mnist        Run (repo root): ./dev/trace_mnist [--batch_size 64] [--graphs 20]
  Includes the trainer with TESTING and MNIST_TRACE (lane 0 of every warp stores three time stamps; see TRACE_SCOPE
  in the trainer), captures GRAPH_STEPS training steps in one graph as the trainer does (SGD, seed 1, the training
  set in the order of epoch 0), replays it --graphs times and reads the stamps of each replay's last step (every
  step overwrites them). Prints, per kernel, medians over the replays in us from that step's first warp, then the
  kernels' phases (TRACE_MARK: when the first, median and last warp passed each).
  --data_dir D (default data/mnist).
  At batch <= 64 the step runs the fused forward: conv2's forward kernel also does fc1's forward and the head (its
  marks 5-7), so those two kernels record nothing.
  --test: 3 replays, then checks the stamps themselves and prints "N passed, N failed, N skipped" (run by
  dev/run_tests.py; skipped without a GPU): every kernel launched in the step recorded its warps in the last step
  (and fc1 forward and head none under the fused forward), each warp's stamps are in order (start <= wait <= end),
  and no kernel's wait returned before every warp of the launch in front had left (the rule grid_dep_sync promises
  the prologues that read memory before it).
*/
#define TESTING
#define MNIST_TRACE
#include "../train_mnist.cu"

// the fast path's kernels in launch order (their TRACE_SCOPE ids)
static const char* TRACE_NAMES[TRACE_KERNELS] = {"conv1+conv2 fwd", "fc1 forward", "head", "fc1 backward",
                                                 "conv2 input grad", "conv2 weight grad"};
// their TRACE_MARK phases (nullptr: unused)
static const char* MARK_NAMES[TRACE_KERNELS][TRACE_MARKS] = {
    {"x in shared memory", "conv1 done, weights in (rounded or copied)", "products done", "pooled stored", "conv1 done (before the weights' wait)",
     "fused: barrier open (all pooled)", "fused: fc1 partial sums stored", "fused: head done (row blocks)"},
    {"operands in shared memory", "products done", "rows in their owners' inboxes", "cluster sum stored", nullptr, nullptr, nullptr, nullptr},
    {"h stored", nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr},
    {"operands in shared memory", "dpooled done", "weight gradient products done", "gradient in shared memory", nullptr,
     "small gradients done (last blocks)", nullptr, nullptr},
    {"patch in shared memory", "first tile's products done", "tiles done (products, combine, epilogue)", "step warp done (fc1.weight's step)",
     nullptr, nullptr, nullptr, nullptr},
    {"bands done", "cluster's partial sums staged", "cluster sum stored", "jobs before the barrier done", "barrier open", nullptr, nullptr, nullptr}};

// One replay's last step, per kernel (times in ns from the step's first warp; -1: nothing recorded); per mark, the
// first, median and last stamp over the warps that passed it in this step
struct KernelSpan {
    double start = -1, start_last = -1, wait_first = -1, wait_last = -1, end_first_block = -1, end = -1, block_span = -1;
    double mark[TRACE_MARKS][3];
    int blocks = 0, warps = 0, bad_order = 0;
};

static std::vector<KernelSpan> read_trace(std::vector<unsigned long long>& buf, std::vector<unsigned long long>& mbuf) {
    cudaCheck(cudaMemcpyFromSymbol(buf.data(), g_trace, buf.size() * sizeof(unsigned long long)));
    cudaCheck(cudaMemcpyFromSymbol(mbuf.data(), g_trace_mark, mbuf.size() * sizeof(unsigned long long)));
    auto at = [&](int k, int b, int w, int i) { return buf[(((size_t)k * TRACE_BLOCKS + b) * TRACE_WARPS + w) * 3 + i]; };
    auto mark_at = [&](int k, int b, int w, int i) { return mbuf[(((size_t)k * TRACE_BLOCKS + b) * TRACE_WARPS + w) * TRACE_MARKS + i]; };
    unsigned long long t0 = ~0ull;
    for (int b = 0; b < TRACE_BLOCKS; b++)
        for (int w = 0; w < TRACE_WARPS; w++)
            if (at(0, b, w, 0)) t0 = std::min(t0, at(0, b, w, 0));
    std::vector<KernelSpan> out(TRACE_KERNELS);
    for (int k = 0; k < TRACE_KERNELS; k++) {
        KernelSpan& s = out[k];
        unsigned long long st = ~0ull, stl = 0, wf = ~0ull, wl = 0, efb = ~0ull, en = 0;
        std::vector<double> spans;
        for (int b = 0; b < TRACE_BLOCKS; b++) {
            unsigned long long bs = ~0ull, be = 0;
            for (int w = 0; w < TRACE_WARPS; w++) {
                unsigned long long a0 = at(k, b, w, 0), a1 = at(k, b, w, 1), a2 = at(k, b, w, 2);
                if (!a0) continue;
                s.warps++;
                if (a2 < a0) s.bad_order++;
                if (a1 >= a0) {  // an older stamp: this warp did not wait in this step
                    if (a1 > a2) s.bad_order++;
                    wf = std::min(wf, a1); wl = std::max(wl, a1);
                }
                bs = std::min(bs, a0); be = std::max(be, a2);
            }
            if (be == 0) continue;
            s.blocks++;
            st = std::min(st, bs); stl = std::max(stl, bs); en = std::max(en, be); efb = std::min(efb, be);
            spans.push_back((double)(be - bs));
        }
        if (!s.blocks) continue;
        std::sort(spans.begin(), spans.end());
        auto rel = [&](unsigned long long t) { return (double)((long long)(t - t0)); };
        s.start = rel(st); s.start_last = rel(stl); s.end = rel(en); s.end_first_block = rel(efb); s.block_span = spans[spans.size() / 2];
        if (wl) { s.wait_first = rel(wf); s.wait_last = rel(wl); }
        for (int i = 0; i < TRACE_MARKS; i++) {
            std::vector<double> v;
            for (int b = 0; b < TRACE_BLOCKS; b++)
                for (int w = 0; w < TRACE_WARPS; w++) {
                    unsigned long long a0 = at(k, b, w, 0), a2 = at(k, b, w, 2), mk = mark_at(k, b, w, i);
                    if (a0 && mk >= a0 && mk <= a2) v.push_back(rel(mk));  // older stamps: not passed in this step
                }
            std::sort(v.begin(), v.end());
            s.mark[i][0] = v.empty() ? -1 : v.front(); s.mark[i][1] = v.empty() ? -1 : v[v.size() / 2];
            s.mark[i][2] = v.empty() ? -1 : v.back();
        }
    }
    return out;
}

static double median(std::vector<double> v) {
    if (v.empty()) return NAN;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main(int argc, char** argv) {
    setvbuf(stdout, nullptr, _IOLBF, 0);
    setenv("CUDA_MODULE_LOADING", "EAGER", 0);
    int B = 64, graphs = 20;
    bool test = false;
    std::string data_dir = "data/mnist";
    for (int i = 1; i < argc; i++) {
        std::string f = argv[i];
        if (f == "--test") { test = true; continue; }
        if (i + 1 >= argc) { fprintf(stderr, "error: %s: unknown flag or missing value\n", f.c_str()); return 1; }
        const char* v = argv[++i];
        if (f == "--batch_size") B = atoi(v);
        else if (f == "--graphs") graphs = atoi(v);
        else if (f == "--data_dir") data_dir = v;
        else { fprintf(stderr, "error: unknown flag %s\n", f.c_str()); return 1; }
    }
    if (test) graphs = 3;
    if (B < 1 || graphs < 1) { fprintf(stderr, "error: --batch_size and --graphs expect positive integers\n"); return 1; }
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        (void)cudaGetLastError();
        if (!test) { fprintf(stderr, "error: no CUDA device\n"); return 1; }
        printf("SKIP trace_mnist: no CUDA device\n0 passed, 0 failed, 1 skipped\n");
        return 0;
    }
    run_config_decide(BACKEND_OURS, 1, 1);
    cudaCheck(cudaStreamCreate(&g_mm.stream));
    MnistSplit train = mnist_load_split(data_dir, "train", 0);
    if ((size_t)graphs * GRAPH_STEPS * B > (size_t)train.n) {
        fprintf(stderr, "error: %d graphs of %d steps of %d images need more than the %d training images\n", graphs, GRAPH_STEPS, B, train.n);
        return 1;
    }
    Mnist m;
    m.opt.total_steps = graphs * GRAPH_STEPS;
    mnist_build(&m, false, B, B);
    mnist_init_params(&m, 1);
    if (!conv2_fast(&m)) { fprintf(stderr, "error: the traced kernels are the fast path's (sm_90, our matmul, TF32)\n"); return 1; }
    const bool fused = mnist_fused_forward(&m, B);  // batch <= 64: conv2's forward kernel runs fc1 and the head
    DeviceData d = upload_split(train, false);
    std::vector<int> perm;
    epoch_permutation(perm, train.n, 1, 0);
    int* perm_dev; float* losses;
    cudaCheck(cudaMalloc(&perm_dev, train.n * 4));
    cudaCheck(cudaMalloc(&losses, train.n * 4));
    cudaCheck(cudaMemcpy(perm_dev, perm.data(), train.n * 4, cudaMemcpyHostToDevice));
    mnist_set_counters(&m, 0, 0);

    cudaGraphExec_t ge = capture_train_steps(&m, d, perm_dev, losses, B, GRAPH_STEPS);
    void* trace_ptr;
    cudaCheck(cudaGetSymbolAddress(&trace_ptr, g_trace));
    std::vector<unsigned long long> buf((size_t)TRACE_KERNELS * TRACE_BLOCKS * TRACE_WARPS * 3);
    std::vector<unsigned long long> mbuf((size_t)TRACE_KERNELS * TRACE_BLOCKS * TRACE_WARPS * TRACE_MARKS);
    cudaCheck(cudaMemset(trace_ptr, 0, buf.size() * sizeof(unsigned long long)));
    cudaCheck(cudaGetSymbolAddress(&trace_ptr, g_trace_mark));
    cudaCheck(cudaMemset(trace_ptr, 0, mbuf.size() * sizeof(unsigned long long)));
    cudaEvent_t e0, e1;
    cudaCheck(cudaEventCreate(&e0)); cudaCheck(cudaEventCreate(&e1));
    std::vector<std::vector<KernelSpan>> runs;
    std::vector<double> per_step;
    for (int r = 0; r < graphs; r++) {
        cudaCheck(cudaEventRecord(e0, g_mm.stream));
        cudaCheck(cudaGraphLaunch(ge, g_mm.stream));
        cudaCheck(cudaEventRecord(e1, g_mm.stream));
        cudaCheck(cudaStreamSynchronize(g_mm.stream));
        float ms; cudaCheck(cudaEventElapsedTime(&ms, e0, e1));
        per_step.push_back(1000.0 * ms / GRAPH_STEPS);
        runs.push_back(read_trace(buf, mbuf));
    }

    if (test) {
        int pass = 0, fail = 0;
        auto check = [&](bool ok, const std::string& name, const std::string& detail) {
            printf("%s trace_mnist %s: %s\n", ok ? "PASS" : "FAIL", name.c_str(), detail.c_str());
            (ok ? pass : fail)++;
        };
        const std::vector<KernelSpan>& s = runs.back();
        int prev = -1;  // the launch in front (the fused forward has no fc1 forward and head launches)
        for (int k = 0; k < TRACE_KERNELS; k++) {
            char buf2[200];
            if ((k == 1 || k == 2) && fused) {
                snprintf(buf2, sizeof buf2, "%d blocks recorded (none expected: the fused forward runs fc1 and the head)", s[k].blocks);
                check(s[k].blocks == 0, std::string(TRACE_NAMES[k]) + " not launched", buf2);
                continue;
            }
            snprintf(buf2, sizeof buf2, "%d blocks, %d warps recorded, %d warps with stamps out of order", s[k].blocks, s[k].warps, s[k].bad_order);
            check(s[k].blocks > 0 && s[k].bad_order == 0, std::string(TRACE_NAMES[k]) + " stamps", buf2);
            if (prev >= 0 && s[k].wait_first >= 0) {
                snprintf(buf2, sizeof buf2, "first wait returned at %.0f ns, the last warp of %s left at %.0f ns", s[k].wait_first,
                         TRACE_NAMES[prev], s[prev].end);
                check(s[k].wait_first >= s[prev].end, std::string(TRACE_NAMES[k]) + " waits for " + TRACE_NAMES[prev], buf2);
            }
            prev = k;
        }
        printf("%d passed, %d failed, 0 skipped\n", pass, fail);
        return fail ? 1 : 0;
    }

    printf("batch %d, %d replays of a %d-step graph: %.2f us per step (median of the replays, CUDA events)%s\n", B, graphs,
           GRAPH_STEPS, median(per_step), fused ? "; the fused forward (no fc1 forward and head launches)" : "");
    printf("the replays' last step, medians in us from its first warp (wait: when grid_dep_sync returned)\n");
    printf("%-18s %7s %9s %9s %9s %9s %9s %9s %7s\n", "kernel", "blocks", "start", "start last", "wait 1st", "wait last",
           "1st done", "end", "block");
    for (int k = 0; k < TRACE_KERNELS; k++) {
        std::vector<double> v[7];
        for (auto& run : runs) {
            const KernelSpan& s = run[k];
            double f[7] = {s.start, s.start_last, s.wait_first, s.wait_last, s.end_first_block, s.end, s.block_span};
            for (int i = 0; i < 7; i++) if (f[i] >= 0) v[i].push_back(f[i] / 1000.0);
        }
        if (v[0].empty()) { printf("%-18s %7d  (not launched in this step)\n", TRACE_NAMES[k], 0); continue; }
        printf("%-18s %7d %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %7.2f\n", TRACE_NAMES[k], runs.back()[k].blocks, median(v[0]),
               median(v[1]), median(v[2]), median(v[3]), median(v[4]), median(v[5]), median(v[6]));
    }
    printf("phases (TRACE_MARK): medians over the replays of the first, median and last warp to pass each mark, us\n");
    printf("%-18s %-40s %9s %9s %9s\n", "kernel", "mark", "first", "median", "last");
    for (int k = 0; k < TRACE_KERNELS; k++)
        for (int i = 0; i < TRACE_MARKS; i++) {
            if (!MARK_NAMES[k][i] || runs.back()[k].blocks == 0) continue;
            std::vector<double> v[3];
            for (auto& run : runs)
                for (int j = 0; j < 3; j++) if (run[k].mark[i][j] >= 0) v[j].push_back(run[k].mark[i][j] / 1000.0);
            printf("%-18s %-40s %9.2f %9.2f %9.2f\n", TRACE_NAMES[k], MARK_NAMES[k][i], median(v[0]), median(v[1]), median(v[2]));
        }
    return 0;
}
