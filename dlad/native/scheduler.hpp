// The scheduler: admission, queues, deadlines, priorities, per-stream freshness, placement and
// batches, owned by the native data plane's thread. It never blocks and never grows without
// bound.
//
// - Admission places a job on one device's bounded queue, or refuses it at once (OVERLOADED:
//   every queue that could take it is full): "full" is an answer, never growth.
// - Placement estimates, for each device that holds the job's model, when the job would finish
//   there: now + in flight(device) + work(queued + this job). The policy then picks: latency,
//   the earliest, or, where the devices slow each other (interference: the Orin's shared
//   DRAM), among those that meet the deadline, the one where the job's completion plus the
//   delay it inflicts on the other devices' jobs is least; throughput, the lowest tier (the DLA
//   cores before the GPU) among the devices estimated to finish by the deadline, earliest
//   first, and the earliest overall when none would; but where a device's host resource is
//   saturated (the frames it runs cost the host more than it has: the plane's thread, or the
//   interpreter that Python engines share), the devices whose resource has room come first,
//   and among saturated ones the cheapest on the host a frame (the host, not the engines,
//   then bounds the daemon's frames/s); static, a stream's frames all go to the
//   device it was pinned to at its first frame (its device in pins, else the device with the
//   fewest pinned streams per unit of speed; a full queue there is OVERLOADED), other frames as
//   latency.
// - Service time is a function of the batch size, seeded at registration (a DLA: its modelled
//   latency; a GPU: a batch curve) and learned online from completions (an exponentially
//   weighted mean per batch size, sizes never seen interpolated); a failure teaches the
//   device's failure rate. A batching device's queued work counts in batches of its max_batch.
// - Host cost a frame is learned online as well (host(): the CPU the plane's thread and the
//   engine's own threads spent on a batch, over its frames), and each host resource's load is
//   set by its owner (set_load(): the busy fraction of the last interval).
// - Order within a device queue: higher priority first, then earlier deadline, then arrival.
// - Batches (next_batch): up to max_batch jobs of one model, in queue order; a partial batch
//   waits at most max_queue_delay_us after its first job was admitted, and never past the point
//   where a full batch could still finish by the earliest deadline in it.
// - Deadlines are checked at dispatch: a job past its deadline is never executed (it comes
//   back expired); expire() sweeps them from the queues.
// - Streams: a new frame of a camera stream supersedes the stream's frame still queued
//   ("latest frame wins").
//
// Every admitted job leaves exactly once: dispatch, expiry, cancellation (explicit or
// superseded) or drain. tests/dlad/test_scheduler.py holds the core to these promises through
// the binding, on random engine pools and operation sequences. The core holds no Python object
// and takes the time as an argument. A job is its id and what placement reads of it.
//
// Floating point: IEEE doubles, and the build turns off FMA contraction (-ffp-contract=off),
// so an aarch64 host (an Orin) rounds as an x86 one does.
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace dlad {

enum class Policy { throughput, latency, statik };

constexpr double kLearnClamp = 4.0;       // scheduler.LEARN_CLAMP
constexpr size_t kMaxPinnedStreams = 4096;  // scheduler.MAX_PINNED_STREAMS
constexpr double kSaturated = 0.85;  // a host resource this busy bounds the frames placed on it

// A device name that was never registered (KeyError in Python).
struct UnknownDevice : std::out_of_range {
    explicit UnknownDevice(const std::string& name) : std::out_of_range(name) {}
};

// Why admit() refused a job (the Python scheduler's exceptions).
enum class Refusal { none, not_found, device_failed, overloaded, duplicate };

struct JobSpec {
    int64_t id = 0;
    std::string model;
    int64_t deadline_ns = 0;
    int64_t priority = 0;
    std::optional<std::string> stream;
    std::string owner;
};

// What the scheduler sets on a job it queues (Job.device, .admitted_ns, .estimate_ns, ._seq).
struct Placed {
    std::string device;
    int64_t admitted_ns = 0;
    int64_t estimate_ns = 0;
    int64_t seq = 0;
};

struct QueueState {  // one device in an Overloaded message: name depth/capacity
    std::string name;
    int64_t depth = 0;
    int64_t capacity = 0;
};

struct AdmitResult {
    Refusal refusal = Refusal::none;
    Placed placed;
    std::vector<int64_t> superseded;  // ids of the stream's queued frame it replaced
    // for the message of a refusal: DeviceFailed, each serving device and whether the retry
    // avoided it (else it is quarantined); Overloaded, the candidates' queues
    std::vector<std::pair<std::string, bool>> unhealthy;
    std::vector<QueueState> full;
};

struct BatchResult {
    std::vector<int64_t> jobs;
    std::vector<int64_t> expired;
    std::optional<int64_t> wait_until_ns;
};

struct Snapshot {
    std::string name;
    int64_t queue_depth = 0;
    int64_t capacity = 0;
    int64_t in_flight = 0;
    double service_time_us = 0.0;
    int64_t completed = 0;
    int64_t max_batch = 1;
    std::vector<int64_t> batches;
    bool available = true;
    double host_us = 0.0;  // host CPU a frame (learned; 0 before the first)
    std::string resource;  // the host resource its frames use
};

class Curve {
  public:
    Curve(std::map<int64_t, double> known, double alpha) : known_(std::move(known)), alpha_(alpha) {}
    double operator()(int64_t size) const;
    void learn(int64_t size, double measured_ns);
    double at1() const { return known_.at(1); }

  private:
    std::map<int64_t, double> known_;  // sorted: interpolation's bisect
    double alpha_;
};

class Scheduler {
  public:
    Scheduler(double alpha, Policy policy,
              std::vector<std::tuple<std::string, std::string, double>> interference,
              std::unordered_map<std::string, std::string> pins);

    // ``known_ns``: the service time (ns) by batch size, holding 1; the caller checked it
    // (the seed curve). Raises std::invalid_argument for a duplicate name.
    void add_device(const std::string& name, const std::vector<std::string>& models,
                    int64_t capacity, int64_t max_batch, const std::map<int64_t, double>& known_ns,
                    int64_t tier, const std::string& kind);
    std::vector<std::string> models() const;  // sorted

    AdmitResult admit(const JobSpec& job, const std::vector<std::string>& avoid, int64_t now);
    std::optional<int64_t> displace_for(const JobSpec& job);
    std::optional<std::string> pinned(const std::string& stream, const std::string& owner) const;

    // (job id or none, expired ids)
    std::pair<std::optional<int64_t>, std::vector<int64_t>> next_job(const std::string& device,
                                                                     int64_t now);
    BatchResult next_batch(const std::string& device, std::optional<int64_t> max_batch,
                           double max_queue_delay_us, int64_t now);
    void finished(const std::string& device, int64_t job, std::optional<double> device_us);
    // A job that ran and teaches nothing (an engine's warm-up: its lazy set-up's cost).
    void released(const std::string& device, int64_t job);
    void finished_batch(const std::string& device, const std::vector<int64_t>& jobs,
                        std::optional<double> device_us);
    // The host resource ``device``'s frames use ("plane" until set: the plane's thread).
    void set_resource(const std::string& device, const std::string& resource);
    // ``host_ns`` of host CPU went into ``frames`` frames of ``device`` (learned per frame).
    void host(const std::string& device, int64_t frames, double host_ns);
    // ``resource`` was busy ``fraction`` of the last interval (throughput placement reads it).
    void set_load(const std::string& resource, double fraction);
    double load(const std::string& resource) const;

    std::vector<int64_t> set_available(const std::string& device, bool available);
    bool available(const std::string& device) const { return dev(device).available; }
    // false: the id is queued already
    bool admit_probe(const std::string& device, const JobSpec& job, int64_t now, Placed* placed);

    std::vector<int64_t> expire(int64_t now);
    std::optional<int64_t> earliest_deadline() const;
    bool cancel(int64_t id);  // false: not queued
    std::vector<int64_t> drain();

    int64_t queued() const { return static_cast<int64_t>(jobs_.size()); }
    int64_t queued(const std::string& device) const { return dev(device).depth; }
    bool has_queued(const std::optional<std::string>& stream, const std::string& owner) const;
    int64_t streams_waiting() const { return static_cast<int64_t>(streams_.size()); }
    int64_t in_flight(const std::string& device) const {
        return static_cast<int64_t>(dev(device).running.size());
    }
    double service_us(const std::string& device, int64_t batch) const {
        return dev(device).curve(batch) / 1e3;
    }
    std::vector<Snapshot> snapshot() const;

    Policy policy;

  private:
    struct Entry {  // a heap entry: (-priority, deadline, sequence, id)
        int64_t neg_priority, deadline, seq, id;
        bool operator<(const Entry& o) const {
            if (neg_priority != o.neg_priority) return neg_priority < o.neg_priority;
            if (deadline != o.deadline) return deadline < o.deadline;
            if (seq != o.seq) return seq < o.seq;
            return id < o.id;
        }
        bool operator>(const Entry& o) const { return o < *this; }
    };
    struct Running {
        int64_t start, est, task;
    };
    struct Device {
        std::string name;
        std::vector<std::string> models;
        int64_t capacity, max_batch;
        Curve curve, seed;
        int64_t tier;
        std::string kind;
        int64_t pinned = 0;
        bool available = true;
        double fail_rate = 0.0;
        std::vector<Entry> heap{};  // a min-heap (std::push_heap with greater)
        int64_t depth = 0;
        std::map<int64_t, Running> running{};  // job id ->
        int64_t completed = 0;
        std::vector<int64_t> batches{};
        std::string resource = "plane";
        double host_ns = 0.0;  // a frame's, learned (0: none yet)
        bool serves(const std::string& model) const;
        double work_ns(int64_t jobs, const Curve* c = nullptr) const;
    };
    struct Job {
        JobSpec spec;
        size_t device = 0;
        int64_t admitted_ns = 0, estimate_ns = 0, seq = 0;
    };
    using Key = std::pair<std::string, std::string>;  // (owner, stream)
    struct KeyHash {
        size_t operator()(const Key& k) const {
            return std::hash<std::string>()(k.first) * 31 + std::hash<std::string>()(k.second);
        }
    };

    const Device& dev(const std::string& name) const;
    Device& dev(const std::string& name);
    size_t choose(const JobSpec& job, const std::vector<size_t>& open, int64_t now) const;
    double induced_ns(size_t device, const std::vector<double>& left) const;
    size_t pin(const Key& stream, const std::vector<size_t>& candidates);
    static int64_t in_flight_ns(const Device& d, int64_t now);
    std::pair<std::optional<int64_t>, std::vector<int64_t>> pop(Device& d, int64_t now);
    Placed enqueue(size_t d, const JobSpec& job, int64_t now);
    bool remove(int64_t id);
    size_t take(int64_t id);  // the job leaves its queue; returns its device
    void learn(Device& d, int64_t size, std::optional<double> device_us);

    double alpha_;
    std::map<std::pair<std::string, std::string>, double> interference_;  // (victim, aggressor)
    // (owner, stream) -> device, least recently seen first (policy static)
    std::list<std::pair<Key, std::string>> pins_;
    std::unordered_map<Key, std::list<std::pair<Key, std::string>>::iterator, KeyHash> pin_at_;
    std::unordered_map<std::string, std::string> by_hand_;
    std::vector<Device> devices_;
    std::unordered_map<std::string, size_t> index_;
    std::unordered_map<std::string, std::vector<size_t>> serving_;
    std::vector<std::vector<std::pair<size_t, double>>> victims_;
    std::unordered_map<int64_t, Job> jobs_;  // queued only
    std::map<int64_t, int64_t> order_;       // seq -> id: the queued jobs in admission order
    std::unordered_map<Key, int64_t, KeyHash> streams_;
    std::unordered_map<std::string, int64_t> owned_;
    std::unordered_map<std::string, double> loads_;  // host resource -> busy fraction
    int64_t seq_ = 0, tasks_ = 0, out_ = 0;
};

}  // namespace dlad
