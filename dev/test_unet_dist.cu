/*
dev/test_unet_dist.cu: the host side of train_unet's data parallelism (issue 23), on the CPU: train_unet.cu is
included with TESTING and only host functions run, so no CUDA or NCCL call is made (CI has neither a GPU nor
always NCCL). The GPU side (the all-reduce, ZeRO-1, the watchdog) is checked by wip/nccl_gpu_check.sh on 2+ GPUs.

  make -C dev test_unet_dist && ./dev/test_unet_dist      (from the repository root)

Checks: the rank variables of each launcher (OpenMPI, torchrun, PMI, Slurm), which one wins when several are set,
and the clear errors for inconsistent ones; the GPU a rank takes; the rank/shard arithmetic (each rank's share of a
step's samples and of its noise stream is the single GPU's, cut in world pieces: the noise through cuRAND's host
Philox generator, the same stream the trainer draws on the GPU); ZeRO-1's shard sizes; the gradient buckets (every
parameter in exactly one, each all-reduced after its layer's backward); the NCCL id handed from rank 0 to every other
rank over TCP and through a file, between real processes (fork); and a peer that never comes: the waiting rank ends
within seconds with an error naming the rank and what it waited for, exit 1.
Prints PASS/FAIL lines and the closing `N passed, N failed, N skipped`.
*/
#define TESTING
#include "../train_unet.cu"

#include <sys/wait.h>

static int n_pass = 0, n_fail = 0, n_skip = 0;
static void report(bool ok, const std::string& name, const std::string& detail) {
    printf("%s %s: %s\n", ok ? "PASS" : "FAIL", name.c_str(), detail.c_str());
    fflush(stdout);
    (ok ? n_pass : n_fail)++;
}
static bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// ------------------------------------------------------------------------------------------------------------------
// the launchers' variables

static const char* DIST_VARS[] = {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                                  "RANK", "WORLD_SIZE", "LOCAL_RANK", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID",
                                  "PMI_LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "MASTER_ADDR",
                                  "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID",
                                  "OMPI_MCA_ess_base_jobid", "PMI_JOBID"};
// sets exactly the given "NAME=value" variables among DIST_VARS
static void set_env(std::initializer_list<const char*> vars) {
    for (const char* v : DIST_VARS) unsetenv(v);
    for (const char* kv : vars) {
        std::string s = kv;
        size_t eq = s.find('=');
        setenv(s.substr(0, eq).c_str(), s.substr(eq + 1).c_str(), 1);
    }
}
static void expect_env(const char* name, std::initializer_list<const char*> vars, int rank, int world, int local,
                       const char* launcher) {
    set_env(vars);
    DistEnv d;
    std::string e = dist_env_parse(&d);
    char got[160];
    snprintf(got, sizeof got, "rank %d world %d local %d (%s)%s%s", d.rank, d.world, d.local_rank,
             d.launcher.c_str(), e.empty() ? "" : ", error: ", e.c_str());
    report(e.empty() && d.rank == rank && d.world == world && d.local_rank == local && d.launcher == launcher,
           std::string("env ") + name, got);
}
// an error that names every part in parts, and a world of 1 left behind
static void expect_env_error(const char* name, std::initializer_list<const char*> vars,
                             std::initializer_list<const char*> parts) {
    set_env(vars);
    DistEnv d;
    d.world = 7;
    std::string e = dist_env_parse(&d);
    bool ok = !e.empty() && d.world == 1 && d.rank == 0;
    for (const char* p : parts) ok = ok && has(e, p);
    report(ok, std::string("env error ") + name, e.empty() ? "no error" : e);
}

static void test_env() {
    expect_env("none: one process", {}, 0, 1, 0, "none");
    expect_env("torchrun", {"RANK=5", "WORLD_SIZE=8", "LOCAL_RANK=1", "MASTER_ADDR=node3", "MASTER_PORT=29400"}, 5,
               8, 1, "torchrun");
    expect_env("OpenMPI", {"OMPI_COMM_WORLD_RANK=3", "OMPI_COMM_WORLD_SIZE=4", "OMPI_COMM_WORLD_LOCAL_RANK=3"}, 3, 4,
               3, "OpenMPI");
    expect_env("PMI (MPICH MPI_LOCALRANKID)", {"PMI_RANK=6", "PMI_SIZE=16", "MPI_LOCALRANKID=2"}, 6, 16, 2, "PMI");
    expect_env("PMI (PMI_LOCAL_RANK)", {"PMI_RANK=1", "PMI_SIZE=2", "PMI_LOCAL_RANK=1"}, 1, 2, 1, "PMI");
    expect_env("Slurm", {"SLURM_PROCID=9", "SLURM_NTASKS=12", "SLURM_LOCALID=1"}, 9, 12, 1, "Slurm");
    expect_env("world of 1 from torchrun", {"RANK=0", "WORLD_SIZE=1", "LOCAL_RANK=0"}, 0, 1, 0, "torchrun");
    // a launcher inside a Slurm allocation: its own variables describe the processes
    expect_env("mpirun inside Slurm: OpenMPI wins",
               {"OMPI_COMM_WORLD_RANK=2", "OMPI_COMM_WORLD_SIZE=4", "OMPI_COMM_WORLD_LOCAL_RANK=0",
                "SLURM_PROCID=0", "SLURM_NTASKS=1", "SLURM_LOCALID=0"}, 2, 4, 0, "OpenMPI");
    expect_env("torchrun inside Slurm: torchrun wins",
               {"RANK=3", "WORLD_SIZE=4", "LOCAL_RANK=3", "SLURM_PROCID=0", "SLURM_NTASKS=1", "SLURM_LOCALID=0"}, 3,
               4, 3, "torchrun");
    expect_env("srun with PMI: PMI before Slurm",
               {"PMI_RANK=1", "PMI_SIZE=2", "MPI_LOCALRANKID=1", "SLURM_PROCID=1", "SLURM_NTASKS=2",
                "SLURM_LOCALID=1"}, 1, 2, 1, "PMI");
    expect_env_error("rank >= world", {"RANK=2", "WORLD_SIZE=2", "LOCAL_RANK=0"},
                     {"RANK=2", "WORLD_SIZE=2", "torchrun"});
    expect_env_error("world 0", {"OMPI_COMM_WORLD_RANK=0", "OMPI_COMM_WORLD_SIZE=0", "OMPI_COMM_WORLD_LOCAL_RANK=0"},
                     {"OMPI_COMM_WORLD_SIZE=0", "OpenMPI"});
    expect_env_error("not a number", {"RANK=1x", "WORLD_SIZE=2", "LOCAL_RANK=0"}, {"RANK='1x'", "integer"});
    expect_env_error("negative", {"SLURM_PROCID=-1", "SLURM_NTASKS=2", "SLURM_LOCALID=0"}, {"SLURM_PROCID='-1'"});
    expect_env_error("empty", {"RANK=0", "WORLD_SIZE=", "LOCAL_RANK=0"}, {"WORLD_SIZE=''"});
    expect_env_error("rank missing", {"WORLD_SIZE=2", "LOCAL_RANK=0"}, {"WORLD_SIZE is set but RANK is not"});
    expect_env_error("local rank missing", {"PMI_RANK=0", "PMI_SIZE=2"}, {"MPI_LOCALRANKID", "PMI_LOCAL_RANK"});
    expect_env_error("local rank above rank", {"RANK=1", "WORLD_SIZE=4", "LOCAL_RANK=3"}, {"local rank 3", "RANK=1"});
    set_env({});
}

static void test_device() {
    set_env({"RANK=3", "WORLD_SIZE=4", "LOCAL_RANK=1"});
    DistEnv d;
    dist_env_parse(&d);
    std::string e;
    int dev = dist_device(d, 2, &e);
    report(dev == 1 && e.empty(), "device: local rank 1 of 2 GPUs", "device " + std::to_string(dev));
    dev = dist_device(d, 1, &e);
    report(dev == -1 && has(e, "rank 3") && has(e, "local rank 1") && has(e, "1 GPU"),
           "device: local rank 1 with 1 GPU is an error", e);
    e.clear();
    setenv("CUDA_VISIBLE_DEVICES", "5", 1);  // a launcher that binds one GPU per process
    dev = dist_device(d, 1, &e);
    report(dev == 0 && e.empty(), "device: one GPU bound per process (CUDA_VISIBLE_DEVICES=5)",
           "device " + std::to_string(dev));
    setenv("CUDA_VISIBLE_DEVICES", "0,1", 1);
    dev = dist_device(d, 1, &e);
    report(dev == -1 && has(e, "CUDA_VISIBLE_DEVICES=0,1"), "device: error names CUDA_VISIBLE_DEVICES", e);
    set_env({});
}

// ------------------------------------------------------------------------------------------------------------------
// shares of the batch and of the noise, ZeRO-1 shards, buckets

static void test_shares() {
    const int N = 37, T = 1000, nsteps = 6, B = 3;
    const long long step0 = 11;
    for (int world : {1, 2, 3, 4}) {
        std::vector<int> codes, ts, c1, t1;
        batch_draws(1337, N, T, step0, nsteps, B * world, &codes, &ts);  // what one GPU with the global batch takes
        std::vector<std::vector<int>> mine(world), mine_t(world);
        for (int r = 0; r < world; r++) {
            mine[r] = dist_share(codes, nsteps, B, world, r);
            mine_t[r] = dist_share(ts, nsteps, B, world, r);
        }
        size_t bad = 0;
        for (int s = 0; s < nsteps; s++)  // rank r's samples are r*B .. r*B+B-1 of every global step, in order
            for (int r = 0; r < world; r++)
                for (int b = 0; b < B; b++) {
                    const size_t g = (size_t)s * B * world + (size_t)r * B + b, l = (size_t)s * B + b;
                    bad += mine[r][l] != codes[g] || mine_t[r][l] != ts[g];
                }
        batch_draws(1337, N, T, step0, nsteps, B, &c1, &t1);
        bool same1 = world != 1 || (mine[0] == c1 && mine_t[0] == t1);
        report(bad == 0 && same1 && mine[0].size() == (size_t)nsteps * B,
               "batch share, world " + std::to_string(world),
               std::to_string(bad) + " samples differ from the single GPU's global batch" +
                   (world == 1 ? same1 ? ", world 1 = the single-GPU draws" : ", world 1 differs from one GPU" : ""));
    }
    // the noise: cuRAND's Philox stream (host generator: same sequence as the device's, no GPU needed)
    curandGenerator_t gen;
    curandCheck(curandCreateGeneratorHost(&gen, CURAND_RNG_PSEUDO_PHILOX4_32_10));
    curandCheck(curandSetPseudoRandomGeneratorSeed(gen, 1337ull));
    const size_t n_local = (size_t)2 * 64 * 64 * 3;  // 2 images of 64x64x3 per rank
    for (int world : {1, 2, 3, 4}) {
        const long long step = 7;
        std::vector<float> global(n_local * world), piece(n_local);
        curandCheck(curandSetGeneratorOffset(gen, dist_noise_offset(step, n_local * world, 1, 0)));
        curandCheck(curandGenerateNormal(gen, global.data(), global.size(), 0.f, 1.f));
        size_t bad = 0;
        for (int r = 0; r < world; r++) {
            curandCheck(curandSetGeneratorOffset(gen, dist_noise_offset(step, n_local, world, r)));
            curandCheck(curandGenerateNormal(gen, piece.data(), n_local, 0.f, 1.f));
            for (size_t i = 0; i < n_local; i++) bad += memcmp(&piece[i], &global[r * n_local + i], 4) != 0;
        }
        report(bad == 0 && dist_noise_offset(step, n_local, 1, 0) == (unsigned long long)step * n_local,
               "noise share, world " + std::to_string(world),
               std::to_string(bad) + " of " + std::to_string(global.size()) +
                   " values differ from the single GPU's stream at step 7");
    }
    curandCheck(curandDestroyGenerator(gen));
    for (int world : {2, 3, 4, 8}) {
        for (size_t n : {(size_t)22080000 + 8, (size_t)1000, (size_t)8}) {
            size_t S = dist_shard_floats(n, world);
            bool ok = S % 64 == 0 && S * world >= n && S * world < n + (size_t)64 * world + world;
            report(ok, "ZeRO-1 shard, n " + std::to_string(n) + ", world " + std::to_string(world),
                   std::to_string(S) + " floats per rank, padded arena " + std::to_string(S * world));
        }
    }
}

static void test_buckets() {
    UNet model;
    UNet* m = &model;
    UNetConfig cfg;  // the default model (22M parameters); unet_define only plans, nothing is allocated
    unet_define(m, cfg, 2);
    for (size_t cap : {(size_t)0, (size_t)1 << 20, (size_t)4 << 20, (size_t)64 << 20}) {
        std::vector<GradBucket> b = dist_plan_buckets(m, cap);
        std::vector<int> hits(m->n_params, 0);
        bool order = true, caps = true;
        for (size_t k = 0; k < b.size(); k++) {
            for (const auto& r : b[k].ranges)
                for (size_t i = r.first; i < r.first + r.second && i < m->n_params; i++) hits[i]++;
            if (k + 1 < b.size()) {
                order = order && b[k].after_op > b[k + 1].after_op && b[k].after_op >= 0;
                caps = caps && cap > 0 && b[k].floats >= cap;
            }
        }
        size_t once = 0, ends = 0;
        for (int h : hits) once += h == 1;
        for (const auto& r : b.back().ranges) ends = std::max(ends, r.first + r.second);
        // the time embedding and every resblock's emb_layers get their gradients after the last op: last bucket
        auto in_last = [&](size_t off) {
            for (const auto& r : b.back().ranges)
                if (off >= r.first && off < r.first + r.second) return true;
            return false;
        };
        bool late = in_last(m->te0.w) && in_last(m->te2.b);
        // a layer's own weights are all-reduced after its backward (ops run backward from the last one)
        bool after = true;
        for (size_t i = 0; i < m->ops.size(); i++) {
            const Op& o = m->ops[i];
            if (o.kind == OP_RES) late = late && in_last(o.emb.w) && in_last(o.emb.b);
            if (o.kind == OP_CAT || o.kind == OP_ATTN) continue;
            for (const GradBucket& g : b)
                for (const auto& r : g.ranges)
                    if (o.c1.w >= r.first && o.c1.w < r.first + r.second)
                        after = after && (g.after_op == -1 || g.after_op <= (int)i);
        }
        report(once == m->n_params && order && (cap == 0 ? b.size() == 1 : caps) && b.back().after_op == -1 &&
                   late && after && ends <= m->n_params,
               "buckets, cap " + std::to_string(cap) + " floats",
               std::to_string(b.size()) + " buckets; " + std::to_string(once) + " of " + std::to_string(m->n_params) +
                   " parameter floats in exactly one" + (order ? "" : ", out of backward order") +
                   (late ? "" : ", an embedding outside the last bucket") +
                   (after ? "" : ", a layer reduced before its backward"));
    }
}

// ------------------------------------------------------------------------------------------------------------------
// the id exchange between processes

static int free_port() {  // a port the kernel just gave out (bind to 0), closed again for the test to use
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof sa;
    bind(fd, (struct sockaddr*)&sa, sizeof sa);
    getsockname(fd, (struct sockaddr*)&sa, &len);
    close(fd);
    return ntohs(sa.sin_port);
}
static DistId random_id(unsigned seed) {
    DistId id;
    for (int i = 0; i < DIST_ID_BYTES; i++) id.b[i] = (unsigned char)(rng_hash(seed, 9, i) & 0xff);
    return id;
}

struct Child {
    pid_t pid = -1;
    int out = -1, err = -1;  // read ends: the id it received, its stderr
};
// A process as train_unet runs it: rank `rank` of `world` fetches (or rank 0 serves) the id; on failure it prints
// the trainer's "error: ..." line and exits 1. delay_ms: it starts late.
static Child spawn_rank(int rank, int world, DistOpts o, const DistId& id0, int delay_ms) {
    int po[2], pe[2];
    if (pipe(po) != 0 || pipe(pe) != 0) {
        perror("pipe");
        exit(EXIT_FAILURE);
    }
    Child c;
    c.pid = fork();
    if (c.pid == 0) {
        close(po[0]);
        close(pe[0]);
        dup2(pe[1], 2);
        usleep(delay_ms * 1000);
        DistEnv d;
        d.rank = rank;
        d.world = world;
        d.launcher = "test";
        DistId id = rank == 0 ? id0 : DistId();
        std::string e = dist_share_id(d, o, &id);
        if (!e.empty()) {
            fprintf(stderr, "error: %s\n", e.c_str());
            _exit(1);
        }
        ssize_t w = write(po[1], &id, sizeof id);
        _exit(w == (ssize_t)sizeof id ? 0 : 2);
    }
    close(po[1]);
    close(pe[1]);
    c.out = po[0];
    c.err = pe[0];
    return c;
}
struct Ended {
    int code = -1;
    bool got_id = false;
    DistId id;
    std::string err;
    double secs = 0;
};
static Ended reap(Child c, double t0) {
    Ended r;
    r.got_id = read(c.out, &r.id, sizeof r.id) == (ssize_t)sizeof r.id;
    char buf[1024];
    ssize_t n;
    while ((n = read(c.err, buf, sizeof buf)) > 0) r.err.append(buf, n);
    int status = 0;
    waitpid(c.pid, &status, 0);
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    r.secs = dist_now() - t0;
    close(c.out);
    close(c.err);
    if (!r.err.empty() && r.err.back() == '\n') r.err.pop_back();
    return r;
}

// every rank of world ends with rank 0's id; rank 0 starts after the others (delay0) or before them
static void exchange(const std::string& name, int world, DistOpts o, int delay0) {
    const DistId id0 = random_id(world * 31 + delay0);
    const double t0 = dist_now();
    std::vector<Child> kids;
    for (int r = 0; r < world; r++) kids.push_back(spawn_rank(r, world, o, id0, r == 0 ? delay0 : 0));
    int same = 0;
    std::string errs;
    double secs = 0;
    for (int r = 0; r < world; r++) {
        Ended e = reap(kids[r], t0);
        same += e.code == 0 && e.got_id && memcmp(&e.id, &id0, sizeof id0) == 0;
        if (e.code != 0) errs += " rank " + std::to_string(r) + " exit " + std::to_string(e.code) + ": " + e.err;
        secs = std::max(secs, e.secs);
    }
    char d[128];
    snprintf(d, sizeof d, "%d of %d ranks hold rank 0's id, %.2f s", same, world, secs);
    report(same == world && errs.empty(), name, d + errs);
}

// the ranks in `started` of a world that has more: the ones in `failing` must exit 1 within limit_s, with an error
// containing every part
static void no_show(const std::string& name, int world, std::vector<int> started, DistOpts o, int failing,
                    const std::vector<std::string>& parts) {
    const double t0 = dist_now();
    const DistId id0 = random_id(77);
    std::vector<Child> kids;
    for (int r : started) kids.push_back(spawn_rank(r, world, o, id0, 0));
    bool ok = true;
    std::string detail;
    for (size_t i = 0; i < kids.size(); i++) {
        Ended e = reap(kids[i], t0);
        if (started[i] != failing) continue;
        bool msg = has(e.err, "error: ");
        for (const std::string& p : parts) msg = msg && has(e.err, p);
        ok = e.code == 1 && msg && e.secs < o.timeout_s + 3.0;
        char d[96];
        snprintf(d, sizeof d, "rank %d exit %d after %.1f s: ", started[i], e.code, e.secs);
        detail = d + e.err;
    }
    report(ok, name, detail);
}

static void test_exchange() {
    set_env({});
    DistOpts o;
    o.timeout_s = 20;
    o.master_addr = "127.0.0.1";
    o.config = 42;
    o.master_port = free_port();
    exchange("TCP id, world 4, rank 0 first", 4, o, 0);
    o.master_port = free_port();
    exchange("TCP id, world 3, rank 0 last (the others retry)", 3, o, 400);
    char dir[] = "/tmp/unet_dist_XXXXXX";
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        exit(EXIT_FAILURE);
    }
    DistOpts f = o;
    f.id_file = std::string(dir) + "/nccl_id";
    exchange("file id, world 3, rank 0 last", 3, f, 300);
    {  // a stale file of another run (world 5) is there first: the readers wait for this run's
        DistEnv stale;
        stale.world = 5;
        DistId junk = random_id(5);
        std::string e = dist_write_id_file(stale, f, junk);
        exchange("file id over a stale file of world 5", 3, f, 300);
        if (!e.empty()) report(false, "stale file written", e);
    }
    unlink(f.id_file.c_str());
    // peers that never come: bounded waits with messages that name the rank and what it waited for
    DistOpts t = o;
    t.timeout_s = 1.0;
    t.master_port = free_port();
    no_show("TCP: rank 0, rank 2 never connects", 3, {0, 1}, t, 0,
            {"rank 0 waited 1 s", "rank 2 of world 3", "--dist_timeout"});
    t.master_port = free_port();
    no_show("TCP: rank 1, rank 0 never starts", 2, {1}, t, 1,
            {"rank 1 waited 1 s", "rank 0's NCCL id at 127.0.0.1:" + std::to_string(t.master_port), "MASTER_ADDR"});
    DistOpts tf = t;
    tf.id_file = std::string(dir) + "/never";
    no_show("file: rank 2, rank 0 never writes", 3, {2}, tf, 2,
            {"rank 2 waited 1 s", "--nccl_id_file " + tf.id_file, "no such file"});
    // launches that disagree end at once with the reason
    t.timeout_s = 20;
    t.master_port = free_port();
    {
        const double t0 = dist_now();
        DistOpts other = t;
        other.config = 43;  // rank 1 started with other flags
        Child c0 = spawn_rank(0, 2, t, random_id(1), 0), c1 = spawn_rank(1, 2, other, random_id(1), 0);
        Ended e0 = reap(c0, t0), e1 = reap(c1, t0);
        report(e0.code == 1 && has(e0.err, "rank 1 runs with other flags") && e1.code == 1 &&
                   has(e1.err, "same command") && e0.secs < 5,
               "TCP: a rank with other flags", e0.err + " | " + e1.err);
    }
    t.master_port = free_port();
    {
        const double t0 = dist_now();
        Child c0 = spawn_rank(0, 2, t, random_id(1), 0), c1 = spawn_rank(1, 3, t, random_id(1), 0);
        Ended e0 = reap(c0, t0), e1 = reap(c1, t0);
        report(e0.code == 1 && has(e0.err, "world size 3, rank 0 has 2") && e1.code == 1 && e0.secs < 5,
               "TCP: a rank with another world size", e0.err + " | " + e1.err);
    }
    {  // the port is taken: rank 0 says so
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in sa;
        memset(&sa, 0, sizeof sa);
        sa.sin_family = AF_INET;
        sa.sin_addr.s_addr = htonl(INADDR_ANY);
        socklen_t len = sizeof sa;
        bind(fd, (struct sockaddr*)&sa, sizeof sa);
        listen(fd, 1);
        getsockname(fd, (struct sockaddr*)&sa, &len);
        t.master_port = ntohs(sa.sin_port);
        DistEnv d;
        d.world = 2;
        DistId id = random_id(3);
        std::string e = dist_share_id(d, t, &id);
        close(fd);
        report(has(e, "cannot listen on port " + std::to_string(t.master_port)) && has(e, "--master_port"),
               "TCP: rank 0's port is taken", e);
    }
    rmdir(dir);
    // MASTER_ADDR / MASTER_PORT when the flags leave them open
    set_env({"MASTER_ADDR=node7", "MASTER_PORT=29411"});
    DistOpts r;
    std::string e = dist_resolve_master(&r);
    report(e.empty() && r.master_addr == "node7" && r.master_port == 29411, "master from MASTER_ADDR/MASTER_PORT",
           r.master_addr + ":" + std::to_string(r.master_port));
    set_env({});
    r = DistOpts();
    e = dist_resolve_master(&r);
    report(e.empty() && r.master_addr == "127.0.0.1" && r.master_port == 29500, "master default (one node)",
           r.master_addr + ":" + std::to_string(r.master_port));
    set_env({"MASTER_PORT=70000"});
    r = DistOpts();
    e = dist_resolve_master(&r);
    report(has(e, "MASTER_PORT=70000"), "MASTER_PORT out of range", e);
    set_env({});
}

// the trainer itself refuses inconsistent variables before it looks for a GPU
static void test_binary() {
    if (access("./train_unet", X_OK) != 0) {
        printf("SKIP train_unet refuses RANK >= WORLD_SIZE: ./train_unet is not built\n");
        n_skip++;
        return;
    }
    FILE* p = popen("RANK=2 WORLD_SIZE=2 LOCAL_RANK=0 ./train_unet --steps 1 2>&1; echo \"exit $?\"", "r");
    std::string out;
    char buf[512];
    while (fgets(buf, sizeof buf, p)) out += buf;
    pclose(p);
    report(has(out, "error: RANK=2 is not below WORLD_SIZE=2 (torchrun variables)") && has(out, "exit 1"),
           "train_unet refuses RANK >= WORLD_SIZE", out.substr(0, out.size() - 1));
}

int main() {
    test_env();
    test_device();
    test_shares();
    test_buckets();
    test_exchange();
    test_binary();
    printf("%d passed, %d failed, %d skipped\n", n_pass, n_fail, n_skip);
    return n_fail ? 1 : 0;
}
