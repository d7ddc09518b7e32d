// The native data plane: an INFER from the ROUTER to an engine and its reply back, on one thread
// and without the interpreter (docs/daemon.md, "The native data plane").
//
// One thread ("dlad-plane") owns the daemon's ROUTER socket once it is handed over: pyzmq creates
// and configures it (CURVE, ZAP, heartbeats, high-water marks), and the plane calls the libzmq
// that pyzmq loaded, through the functions ZmqApi resolves. Per message:
//   - an INFER the request decoder takes (wire.hpp) is checked against the frontend's bounds (the
//     client's in-flight cap, the daemon's byte budget, a request id in use), admitted into the
//     scheduler's C++ core (scheduler.hpp) with the frontend's deadline rule, run on an engine
//     when one of its slots is free, and answered from here: OK with its timing, or the typed
//     error with the Python frontend's words (not found, overloaded, displaced, superseded,
//     deadline passed, shutting down);
//   - every other message (STATUS, CANCEL, INFER_BATCH, a refused one, an INFER in a segment
//     not registered yet)
//     goes whole, its routing id first, to the ``forward`` socket, where the control plane in
//     Python answers it through send().
// Every frame runs on an engine (engine.hpp: one interface): an emulated DLA core in timing mode
// (timing_engine.hpp), a real one through cuDLA (cudla_engine.hpp), either with GPU
// pre/post-processing around each task (chain_engine.hpp), or an engine built from Python (a
// callable run on the engine's own threads: the numeric emulation, the GPU's inference). The
// plane takes a batch off the scheduler whenever an engine has a free slot (one job, or up to
// its max_batch in dynamic batches), and answers each job from the engine's report.
// The engines report through an eventfd the thread polls beside the socket. Counters are read
// from any thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cudla_engine.hpp"
#include "dram.hpp"
#include "engine.hpp"
#include "gpu_chain.hpp"
#include "scheduler.hpp"
#include "wire.hpp"

namespace dlad::plane {

// libzmq 4's C API, the part the plane calls (zmq.h). pyzmq's wheels carry the library but not
// its header; the functions are looked up in the library the process has loaded.
struct alignas(8) ZmqMsg {
    unsigned char bytes[64];
};
struct ZmqPollItem {
    void* socket;
    int fd;
    short events;
    short revents;
};
struct ZmqApi {
    int (*msg_init)(ZmqMsg*);
    int (*msg_init_size)(ZmqMsg*, size_t);
    int (*msg_recv)(ZmqMsg*, void*, int);
    int (*msg_send)(ZmqMsg*, void*, int);
    int (*msg_close)(ZmqMsg*);
    int (*msg_move)(ZmqMsg*, ZmqMsg*);
    void* (*msg_data)(ZmqMsg*);
    size_t (*msg_size)(const ZmqMsg*);
    int (*msg_more)(const ZmqMsg*);
    int (*send)(void*, const void*, size_t, int);
    int (*poll)(ZmqPollItem*, int, long);
    int (*errno_)();
    const char* (*msg_gets)(const ZmqMsg*, const char*);
    int (*msg_get)(const ZmqMsg*, int);

    // The API of the libzmq at ``path`` (already loaded: it is not loaded again). Throws
    // std::runtime_error naming what is missing.
    static ZmqApi load(const std::string& path);
};

// One message part, closed when dropped.
class Part {
  public:
    explicit Part(const ZmqApi* api) : api_(api) { api_->msg_init(&msg_); }
    Part(Part&& o) noexcept;
    Part& operator=(Part&&) = delete;
    Part(const Part&) = delete;
    ~Part() { api_->msg_close(&msg_); }
    ZmqMsg* get() { return &msg_; }
    const uint8_t* data() { return static_cast<const uint8_t*>(api_->msg_data(&msg_)); }
    size_t size() const { return api_->msg_size(&msg_); }

  private:
    const ZmqApi* api_;
    ZmqMsg msg_{};
};

// A model's detection settings (``[models.*]`` conf_threshold, iou_threshold, max_det).
struct ModelSettings {
    double conf = 0;
    double iou = 0;
    int64_t max_det = 0;
};

struct DeviceSpec {
    std::string name;
    double latency_us = 0;  // the engine's service time for one task (an emulated core's in
                            // timing mode; for the others, the scheduler's first estimate)
    int64_t slots = 2;      // batches in flight on it at once (the DLA executor's slots)
    int64_t capacity = 4;   // its queue in the scheduler
    std::string kind = "dla";  // "dla" or "gpu" for the DRAM model ("": it shares none); an
                               // engine of none of the kinds below is an emulated DLA core,
                               // or with "gpu" the emulated GPU, in timing mode
    int64_t max_batch = 1;     // the most jobs a batch holds (a GPU's dynamic batches)
    double max_queue_delay_us = 0;  // how long a partial batch may wait for more
    // the service time by batch size (µs), where more than batch 1 is known (a GPU's curve)
    std::map<int64_t, double> curve_us;
    int64_t tier = 0;  // placement's tier (the throughput policy takes the lowest first)
    // GPU pre/post-processing, one GpuSlotSpec per slot (``slots`` is then their number);
    // none: the reply carries no detections (pre/post off)
    std::optional<GpuSpec> gpu;
    // With ``gpu``: the GPU's inference itself, one CUDA graph per batch size (``graphs[n - 1]``
    // a batch of n, gpu_batch_engine.hpp; ``gpu`` then has ``slots * max_batch`` GpuSlotSpecs);
    // none: ``gpu`` is the chain around a DLA core's task
    std::vector<void*> graphs;
    // A real DLA core, driven through cuDLA (one CudlaSlotSpec per slot); none: an emulated
    // core in timing mode
    std::optional<CudlaSpec> cudla;
    // An engine built elsewhere (a Python-backed one, module.cpp), given the callback for its
    // reports; it takes precedence over the kinds above
    std::function<std::unique_ptr<Engine>(OnFinished)> make;
};

// [health]: judged by the results of an engine's tasks (dlad/config.py's HealthConfig).
struct HealthConfig {
    int64_t quarantine_after = 5;  // failed tasks in a row that quarantine an engine (0: never)
    bool retry = true;             // a frame that failed is placed once more on another engine
    double probe_after_s = 1.0;    // a quarantined engine's first rest before its probe
    double probe_max_s = 30.0;     // the longest rest (it doubles after each failed probe)
};

// What the plane's health keeping did, for the control plane's log and metrics.
struct HealthEvent {
    enum Kind { quarantined = 0, returned = 1, probe_failed = 2, retried = 3, warmed = 4 };
    Kind kind = quarantined;
    std::string device;   // the engine (retried: the one it failed on)
    std::string reason;   // why (returned, and warmed where its warm-up went through: "")
    double seconds = 0;   // quarantined: jobs moved; returned: how long it was out;
                          // probe_failed: the next rest
    std::string client;   // retried: the request's client and id, and where it went
    uint64_t request_id = 0;
    std::string to;
};

struct Config {
    wire::Limits limits;
    HealthConfig health;
    double default_deadline_ms = 1000;  // [daemon]
    double max_deadline_ms = 60000;
    int64_t max_in_flight_per_client = 64;  // [frontend]
    uint64_t max_buffered_bytes = 256ull << 20;
    std::vector<DeviceSpec> devices;
    std::map<std::string, std::vector<std::string>> models;  // model -> the devices serving it
    // model -> its [models.*] detection settings, for an INFER that sets none: the plane
    // resolves them for every engine (one for each model of ``models``)
    std::map<std::string, ModelSettings> settings;
    Policy policy = Policy::latency;                         // [scheduler]
    double alpha = 0.2;
    bool shm = false;  // [shm] enabled: INFERs naming a segment the control plane registered
    bool curve = false;  // [auth] mode = "curve": a client is its key (User-Id), not its connection
    double cheap_requests_per_s = 100;  // [frontend]: a client's STATUS and CANCEL, bursts of 2x
    std::unordered_map<std::string, std::string> pins;  // stream -> device (policy static)
    CudaApi cuda{};  // the driver's functions, where a device has GPU pre/post
    CudlaApi cudla{};  // cuDLA's and NvSciSync's, where a device is a cuDLA core
    // [soc] dram_contention: the emulated DRAM the cores share with the daemon's other emulated
    // engines (none: they never slow each other); the scheduler's estimates know it too
    std::shared_ptr<SharedDram> dram;
};

struct Counters {
    int64_t received = 0;   // messages read from the ROUTER
    int64_t forwarded = 0;  // of them, handed to the control plane
    int64_t refused_over_rate = 0;  // malformed ones past their client's rate, refused here
    int64_t refused_busy = 0;  // the control plane's ones refused: it was far behind
    int64_t dropped_over_rate = 0;  // cheap ones past twice their client's refusals, unanswered
    int64_t cut = 0;  // connections shut down for flooding past their drops
    int64_t orphaned = 0;  // replies not sent: their connection had closed
    int64_t cancelled_on_close = 0;  // queued INFERs cancelled as their connection closed
    int64_t replied = 0;    // the plane's own INFER replies, sent or dropped
    int64_t dropped = 0;    // replies ZeroMQ could not queue (the plane's and the control plane's)
    int64_t forward_lost = 0;  // messages the forward socket could not queue (its peer stalled)
    int64_t observations_lost = 0;  // replies not observed: the control plane fell far behind
    int64_t shm_frames = 0;  // INFERs whose frame lay in a registered shared-memory segment
    int64_t gpu_errors = 0;  // frames whose GPU chain could not be queued (DEVICE_FAILED)
    std::string last_gpu_error;  // the last one's words
    std::map<std::string, int64_t> by_status;  // the plane's INFER replies, by status name
};

// One INFER answered by the plane, for the daemon's metrics (Metrics.observe_reply's fields).
struct Observation {
    std::string model;
    std::string device;  // "" when it never reached one
    int64_t status = 0;
    uint64_t queue_us = 0;
    uint64_t device_us = 0;
    uint64_t total_us = 0;
};

// The scheduler's state and the engines' counts, for STATUS and the gauges.
struct State {
    std::vector<Snapshot> devices;
    std::map<std::string, int64_t> busy_ns;  // device -> its tasks' time so far
    std::map<std::string, int64_t> failed;   // device -> its frames answered DEVICE_FAILED
    std::map<std::string, int64_t> failing;  // device -> of them, the last in a row
    std::map<std::string, std::string> last_failure;  // device -> the last one's words
    std::map<std::string, std::string> quarantined;  // device -> why, while it is
    std::map<std::string, int64_t> quarantines;  // device -> how often it was, since start
    int64_t queued = 0;
    int64_t streams_waiting = 0;
};

// An image the control plane decoded (an INFER whose segment it mapped, an INFER_BATCH's image), for
// submit(): what the plane needs of it.
struct Item {
    std::string model;
    std::optional<std::string> stream;
    int64_t priority = 0;
    std::optional<int64_t> deadline_ms;
    uint64_t size = 0;  // the image's bytes in the daemon's budget (0: in shared memory)
    std::optional<std::string> shm;  // the registered segment it lies in, by name
    uint64_t shm_offset = 0;         // and where in it
    Image image;
    std::shared_ptr<const std::string> pixels;  // the image's bytes (none: in the segment)
};

// What cancel() found.
enum class CancelResult { cancelled = 0, not_queued = 1, running = 2 };

class Plane {
  public:
    // ``router``: the daemon's ROUTER (the plane's alone from start() to the thread's end);
    // ``forward``: a socket the plane sends the messages it leaves on (a PAIR the control plane
    // reads), each as [routing id, its parts...]. Throws std::invalid_argument for a device or
    // model the config names wrongly.
    Plane(ZmqApi api, void* router, void* forward, Config config);
    ~Plane();
    Plane(const Plane&) = delete;
    Plane& operator=(const Plane&) = delete;

    void start();
    // Stop taking INFERs (SHUTTING_DOWN), answer what is queued and running as it finishes, and
    // after ``timeout_ms`` answer the rest SHUTTING_DOWN; read what the socket holds then (its
    // INFERs answered SHUTTING_DOWN, the rest forwarded); then the thread ends, and a message
    // that comes later is the caller's. Blocks until it has; idempotent.
    void drain(double timeout_ms);
    // A reply of the control plane's (to a forwarded message): sent from the plane's thread
    // (from the caller's once that thread has ended).
    // ``conn``: the connection the answered message came on (Plane::connection_of, from its
    // forwarded message), or "": a reply for a connection that has closed since is dropped,
    // counted as orphaned (a newcomer on the same routing id gets none).
    void send(std::string client, std::vector<std::string> frames, const std::string& conn = "");
    // The 16 bytes naming a connection as forwarded messages carry it: its fd, that fd's
    // generation and its socket's SO_COOKIE (little-endian int32, uint32, uint64).
    std::string connection_of(int fd) const;
    // drain(0), then stop the engines and wait for the GPU chains still running (their host
    // functions): after this, nothing of the plane runs and the GPU's resources may be freed.
    // Idempotent; the destructor's.
    void close();
    Counters counters() const;

    // The calls below run on the plane's thread (the caller waits: one turn of its loop at
    // most), or on the caller's where that thread is not running.

    // CANCEL of ``client``'s INFER ``request_id``: a queued one is answered CANCELLED.
    CancelResult cancel(const std::string& client, uint64_t request_id);
    // Admit images the control plane decoded as one request of ``client`` (``owner``: who it
    // is for the in-flight cap). The request's room is checked as a whole first (draining, its
    // id in use, the client's cap, the byte budget): a refusal admits none and is returned as
    // (status, message). Else each image is admitted as the plane's INFERs are; its answer
    // (the INFER_REPLY header, a refusal's included) goes to the client when ``tag`` is unset,
    // else to the forward socket as ["", tag, index, header] (8-byte little-endian integers),
    // for the control plane to gather (an INFER_BATCH's reply). ``conn``: the connection the
    // request came on (as send()'s): its images are cancelled when it closes.
    std::optional<std::pair<int64_t, std::string>> submit(const std::string& client,
                                                          const std::string& owner,
                                                          uint64_t request_id,
                                                          std::optional<int64_t> tag,
                                                          std::vector<Item> items,
                                                          const std::string& conn = "");
    State state();
    // Shared-memory segments (the control plane maps them, checks them and the peer, and
    // registers them here; an INFER naming one that is not registered, or not at that size,
    // or whose frame would not fit, is forwarded). A segment is held while frames of it are
    // admitted and not yet answered.
    // Register ``owner``'s segment ``name`` of ``size`` bytes whose header holds ``token``,
    // mapped at ``host`` here (and at ``device`` for the GPU, 0: not registered there): false
    // where it is registered at another size with frames in flight (a client must not resize
    // a segment in use). An INFER naming it with another token is forwarded.
    bool add_segment(const std::string& owner, const std::string& name, uint64_t size,
                     const std::string& token, const uint8_t* host = nullptr,
                     uint64_t device = 0);
    // Unregister it: false while frames of it are in flight (it stays).
    bool drop_segment(const std::string& owner, const std::string& name);
    // Unregister the segments no frame holds that have not been used for ``idle_ms``; returns
    // them as (owner, name), for the control plane to unmap.
    std::vector<std::pair<std::string, std::string>> idle_segments(double idle_ms);
    // The replies observed since the last call (at most kMaxObservations are kept).
    std::vector<Observation> take_observations();
    // Take ``device`` out of placement now (its queued frames placed again elsewhere), to be
    // probed after [health] probe_after_s: a failed warm-up. Throws UnknownDevice.
    void quarantine(const std::string& device, const std::string& reason);
    // One task on a blank frame for each of ``devices``, ahead of any client's, so that no
    // client pays for an engine's lazy set-up; each ends in a ``warmed`` event (its reason
    // empty where the task went through). It teaches the scheduler nothing and counts neither
    // as a failure nor as a frame; a failed one quarantines the engine (where [health]
    // quarantine_after > 0). Throws UnknownDevice.
    void warm_up(const std::vector<std::string>& devices);
    // Probe a quarantined ``device`` now instead of after its rest (an operator's "try it
    // again"); false where it is not quarantined. Throws UnknownDevice.
    bool probe_now(const std::string& device);
    // The health events since the last call.
    std::vector<HealthEvent> take_events();
    static constexpr size_t kMaxObservations = size_t{1} << 20;
    int64_t pending() const { return pending_.load(); }
    // Connections, by the file descriptor each is on (the socket's monitor tells the control
    // plane of each accepted and each closed one, and each message carries its descriptor,
    // ZMQ_SRCFD). A connection's replies and queued work are its own, not its routing id's: a
    // new connection that takes a closed one's routing id inherits nothing.
    // A connection was accepted on ``fd``: it has not spoken yet (the fd's generation moves
    // when a connection on it closes).
    void connection_opened(int fd);
    // The connection on ``fd`` closed: its generation ends (its replies are dropped from now
    // on, counted), and its queued work is cancelled (counted); returns how many were. The
    // monitor may tell of a close after a new connection has taken the fd and sent work: work
    // whose socket (SO_COOKIE, read as each message is) is not the one connection_opened saw
    // on the fd is a newer connection's, and is kept, moved to the new generation, and
    // answered.
    int64_t connection_closed(int fd);
    // Whether a message has come from the connection on ``fd`` since it was opened: the
    // connection cap counts connections that have spoken, so that connections that never
    // finish a handshake cannot take authenticated clients' places.
    bool spoke(int fd) const {
        return fd >= 0 && fd < kMaxFds && spoke_[fd].load(std::memory_order_relaxed) != 0;
    }
    static constexpr int kMaxFds = 1 << 16;
    // The image bytes of the frames admitted and not yet answered (the byte budget's count).
    uint64_t buffered_bytes() const { return buffered_bytes_.load(); }
    bool draining() const {
        std::lock_guard<std::mutex> lock(mu_);
        return draining_;
    }

  private:
    struct Job {
        std::string client;
        uint64_t request_id = 0;
        std::optional<int64_t> tag;  // an image of a submit() with a tag: answered to the pair
        int64_t index = 0;
        std::string owner;
        std::string model;
        int64_t received_ns = 0;
        int64_t dispatched_ns = 0;
        uint64_t size = 0;
        std::shared_ptr<Part> payload;  // the frame, alive until the reply (and its task)
        std::string segment;  // the shared-memory segment it holds ("": none)
        uint64_t shm_offset = 0;  // where in the segment the frame lies
        std::string device;
        Image image;          // its shape and settings (GPU pre/post)
        std::shared_ptr<const std::string> pixels;  // a submitted image's bytes (none:
                                                    // payload or segment)
        JobSpec spec;          // as the scheduler knows it (a retry places it again)
        bool retried = false;  // it failed once and was placed again
        bool probe = false;    // a health probe or a warm-up: no client waits for it
        bool warm = false;     // an engine's warm-up (a probe too)
        int fd = -1;               // the connection it came on (-1: the control plane's)
        uint32_t generation = 0;   // and that connection's generation then
        uint64_t cookie = 0;       // and its socket's SO_COOKIE (0: unknown)
    };
    // An engine's health
    struct Watch {
        bool quarantined = false;
        std::string reason;
        double rest_s = 0;
        int64_t probe_at_ns = 0;
        int64_t probe = -1;  // the probe's job id while one is placed
        int64_t quarantines = 0;
        int64_t since_ns = 0;
    };

    void run();
    void wake();
    void call(const std::function<void()>& fn);  // on the plane's thread (see cancel())
    void run_calls();
    int read_messages();  // how many it read (at most kBurst)
    void handle(std::vector<Part>& parts);
    // Hand a message to the control plane, or refuse it OVERLOADED where the control plane is
    // behind (``address``: what its header yielded to address the refusal).
    void forward(std::vector<Part>& parts, const wire::Refusal& address);
    // A message for the forward socket: a client's (routing id first) or an outcome's frames.
    struct Pending {
        std::vector<Part> parts;
        std::vector<std::string> frames;
    };
    // Send it (``flags``: ZMQ_DONTWAIT or 0, the socket's send timeout then); false where the
    // socket took none of it (full: nothing is lost, it is sent later).
    bool send_forward(Pending& m, int flags);
    // Send what waits, in order, while the socket takes it (``block``: waiting for room, each
    // for the socket's send timeout at most, what it still cannot take then being lost).
    void flush_backlog(bool block);
    std::string property(std::vector<Part>& parts, const char* name);  // "" where none
    void infer(std::vector<Part>& parts, const wire::Request& req);
    // The room check of one request (Frontend._room): (status, message) of a refusal;
    // ``own``: set to whether a refusal is of the client's own making (its cap, an id in
    // flight) rather than the daemon's state (draining, the byte budget).
    std::optional<std::pair<int64_t, std::string>> room(const std::string& key,
                                                         uint64_t request_id,
                                                         const std::string& owner,
                                                         int64_t frames, uint64_t size,
                                                         bool* own = nullptr);
    // Admit one image into the scheduler; false once its refusal is answered.
    bool admit(Job job, const std::string& key, const Item& item, int64_t now,
               std::shared_ptr<Part> payload);
    void refuse(const Job& job, int64_t status, const std::string& message);
    // A refused admission's status and words (Frontend's), for ``model``
    static std::pair<int64_t, std::string> refusal(const AdmitResult& r, const std::string& model,
                                                   int64_t id);
    // Health (the plane's thread): a failed frame placed once more elsewhere (false: answer
    // it); an engine quarantined, its queued frames placed again; probes when their rest is
    // over; a probe's end
    bool retry(int64_t job_id, const std::string& failed_on, const std::string& why);
    void quarantine_now(const std::string& device, const std::string& reason, int64_t now);
    void start_probes(int64_t now);
    // A blank frame's job for ``device`` alone (a probe, or a warm-up): its id, or -1
    int64_t place_blank(const std::string& device, bool warm, int64_t now);
    void warmed(const std::string& device, const std::string& why, int64_t now);
    void probe_ended(const std::string& device, bool ok, const std::string& why, int64_t now);
    void event(HealthEvent e);
    // ``detections``: the reply's second frame (none: an empty one)
    void deliver(const Job& job, const std::string& header, int64_t status,
                 std::string_view detections = {});
    void observe(const Job& job, int64_t status, const std::optional<std::string>& device,
                 const wire::Timing& timing);
    // ``ran``: the engine's report of the job's batch where it ran (its span; else none),
    // ``result``: the job's own (its detections and pre/post times; else none)
    void answer(int64_t job_id, int64_t status, const std::string& message,
                const Finished* ran = nullptr, const JobResult* result = nullptr);
    void dispatch(int64_t now);
    // The jobs ``ids`` (taken off ``device``'s queue) as its engine reads them
    std::vector<Work> work_of(const std::vector<int64_t>& ids, int64_t now);
    // An engine's report, on the plane's thread: its jobs answered, its slot counted free
    void finished(const std::string& device, const Finished& f);
    // Every 50 ms: each host resource's busy fraction since the last, for the scheduler.
    void update_loads(int64_t now);
    void take_completions();
    void send_outbox();
    void send_reply(const std::string& client, const std::string& header, const void* payload,
                    size_t payload_bytes, int64_t status, bool payload_frame = true);
    // Whether a cheap message (STATUS, CANCEL, one the decoder refuses) of this client is within
    // its rate ([frontend] cheap_requests_per_s, bursts of twice that: a token bucket per
    // client identity), past it (the plane answers OVERLOADED itself, so that no client's flood
    // fills the control plane's queue), or past as many refusals again, 64 at least (dropped
    // unanswered, counted: the plane then spends a lookup on each and sends nothing).
    enum class Rate { kWithin, kRefuse, kDrop };
    Rate over_rate(std::vector<Part>& parts);
    // The message just read came from ``fd`` under routing id ``id``: a connection not seen
    // before has its socket's cookie taken now, while the fd surely holds its socket (its
    // first message is read within a turn of the socket's fair queue).
    void saw(int fd, Part& id);
    // Whether the connection whose socket is ``cookie`` came on ``fd`` after the last one the
    // monitor told of a close on, and holds the fd now (a reply read before that close is then
    // still its own).
    bool newer_connection(int fd, uint64_t cookie) const;
    // A message of the connection at reading_ was dropped over its rate: past as many as it
    // may have refusals, the connection is shut down (where the fd still holds the socket whose cookie was
    // taken), so that a flood cannot grow what libzmq has read and the plane not yet.
    void dropped_from();
    void refuse_over_rate(std::vector<Part>& parts, const wire::Refusal& refusal);
    // Answer OVERLOADED a message the control plane does not see (``refusal``: what its header
    // yielded, to address the reply), counted in ``counter``.
    void refuse_unread(const std::string& client, const wire::Refusal& refusal,
                       const std::string& words, int64_t Counters::*counter);
    std::string rate_words(const char* what) const;
    static std::string client_of(std::vector<Part>& parts);
    long poll_timeout(int64_t now) const;

    ZmqApi api_;
    void* router_;
    void* forward_;
    Config config_;
    Scheduler scheduler_;
    std::shared_ptr<SharedDram> dram_;  // before the engines that use it
    std::map<std::string, std::unique_ptr<Engine>> engines_;
    std::map<std::string, double> batch_delay_us_;  // device -> max_queue_delay_us
    std::map<std::string, int64_t> running_;  // device -> batches on it
    std::map<std::string, int64_t> busy_ns_;  // device -> its tasks' time so far
    std::map<std::string, int64_t> failed_;   // device -> its frames answered DEVICE_FAILED
    std::map<std::string, int64_t> failing_;  // device -> of them, the last in a row
    std::map<std::string, std::string> last_failure_;
    std::optional<int64_t> batch_wake_ns_;  // when a partial batch waiting for more is due
    std::map<std::string, Watch> watches_;   // device -> its health
    std::unordered_map<std::string, std::pair<double, int64_t>> buckets_;  // owner -> (its
                                                                           // tokens, when)
    std::map<std::string, int64_t> engine_free_ns_;  // a batching engine: when its batches on
                                                     // it are expected to have left (0: idle)
    std::map<std::string, double> pre_ns_;   // a batching engine: a batch's pre-processing
    // What frames cost the host (scheduler.hpp, placement): the plane's thread's CPU in a
    // device's start() a frame (EWMA), each device's host resource ("plane": this thread;
    // "interpreter": a Python engine's), and the CPU the engines' threads reported this
    // interval, by resource; the interval's start (wall clock, this thread's CPU)
    std::map<std::string, double> start_ns_;
    std::map<std::string, std::string> resource_;
    std::map<std::string, int64_t> resource_busy_ns_;
    int64_t load_since_ns_ = 0, load_cpu_ns_ = 0;
    std::map<std::string, std::string> first_model_;  // device -> a model it serves (probes)
    struct Segment {
        uint64_t size = 0;
        std::string token;  // what its header holds (protocol.shm_header)
        int64_t users = 0;  // its frames admitted and not yet answered
        int64_t last_used_ns = 0;
        const uint8_t* host = nullptr;  // where it is mapped here
        uint64_t device = 0;            // and for the GPU (0: not registered there)
    };
    std::unordered_map<std::string, Segment> segments_;  // owner + NUL + name -> segment
    std::unordered_map<int64_t, Job> jobs_;
    std::unordered_map<std::string, int64_t> in_use_;  // client + request id -> its jobs
    std::unordered_map<std::string, int64_t> in_flight_;  // owner -> jobs
    uint64_t buffered_ = 0;
    // Messages the forward socket could not take yet (its reader has fallen a high-water mark
    // behind): while any wait, the plane reads no more off the ROUTER, so that the clients'
    // sockets push back and nothing is lost.
    std::deque<Pending> backlog_;
    int64_t next_job_ = 0;
    int event_fd_ = -1;

    mutable std::mutex mu_;  // guards the fields below, shared with engines and callers
    std::vector<std::pair<std::string, Finished>> done_;  // engines' reports, by device
    std::vector<std::pair<std::string, std::vector<std::string>>> outbox_;
    struct Call {
        const std::function<void()>* fn;
        bool done = false;  // under mu_
    };
    std::vector<Call*> calls_;  // each its caller's, who waits for done
    std::condition_variable called_;
    std::vector<Observation> observations_;
    std::vector<HealthEvent> events_;
    bool events_signalled_ = false;  // the control plane was told of events it has not taken
    Counters counters_;
    bool draining_ = false;
    bool shed_ = false;  // the queue was answered SHUTTING_DOWN when draining began (plane's)
    bool running_thread_ = false;  // the thread runs its loop: calls wait for it
    int64_t drain_until_ns_ = 0;

    std::atomic<int64_t> pending_{0};
    std::unique_ptr<std::atomic<uint8_t>[]> spoke_{new std::atomic<uint8_t>[kMaxFds]()};
    std::unique_ptr<std::atomic<uint32_t>[]> generation_{new std::atomic<uint32_t>[kMaxFds]()};
    // per fd, the socket (SO_COOKIE) of the connection the monitor last told of an accept on,
    // until it tells of its close; and that of the last one it told of a close on (0: none)
    std::unique_ptr<std::atomic<uint64_t>[]> opened_cookie_{new std::atomic<uint64_t>[kMaxFds]()};
    std::unique_ptr<std::atomic<uint64_t>[]> closed_cookie_{new std::atomic<uint64_t>[kMaxFds]()};
    // Each connection as the plane's thread first saw it (docs/reliability.md, "A flood that
    // vanishes"), by its routing id's hash: its fd, the generation of that fd then, the
    // socket's cookie (SO_COOKIE) when its first message was read (0: unknown, never cut), and
    // its messages dropped over its rate. A connection past as many drops as it may have
    // refusals is cut (dropped_from).
    struct Peer {
        int fd = -1;
        uint32_t generation = 0;
        uint64_t cookie = 0;
        uint32_t dropped = 0;
        bool cut = false;  // what it had sent is dropped as it is read, unparsed
        int64_t stale_ns = 0;  // when its fd was seen holding another socket (cookie 0)
    };
    std::unordered_map<uint64_t, Peer> peers_;
    Peer* reading_ = nullptr;  // the connection of the message handle() is at (null: unknown)
    std::atomic<uint64_t> buffered_bytes_{0};
    std::mutex join_mu_;
    std::mutex inline_mu_;  // calls and sends made on the caller's thread, one at a time
    std::thread thread_;
};

}  // namespace dlad::plane
