// Pipeline schedules as pure data: (kind, p, m, v) -> for each rank, the ordered list of
// actions it executes (compute of a micro-batch on a stage, or a send/receive between
// neighbouring stages). Plain C++ (no torch header): the Python executor
// (torchpar/parallel/pipeline/schedules.py) only walks these lists, and the simulator
// (simulate.cpp) checks them without any process group.
#pragma once

#include <array>
#include <string>
#include <vector>

namespace torchpar::pipeline {

enum class ActionType {
  F,       // forward of (microbatch, stage)
  B,       // backward: the full backward, or only the input gradient when the schedule splits it
  W,       // weight gradient of a split backward (zero bubble, arXiv:2401.10241)
  SEND_F,  // send stage's output activation to stage + 1
  RECV_F,  // receive stage's input activation from stage - 1
  SEND_B,  // send the gradient of stage's input to stage - 1
  RECV_B,  // receive the gradient of stage's output from stage + 1
};

struct Action {
  ActionType type;
  int microbatch;
  int stage;  // global stage index, 0 .. num_stages - 1
  bool operator==(const Action&) const = default;
};

enum class ScheduleKind { GPipe, OneFOneB, Interleaved1F1B, ZeroBubbleH1, InterleavedZeroBubble, LoopedBFS, Custom };

struct Schedule {
  ScheduleKind kind = ScheduleKind::Custom;
  int num_ranks = 0;         // p
  int num_microbatches = 0;  // m
  int stages_per_rank = 1;   // v; stage s lives on rank s % p (looped placement)
  bool split_backward = false;
  std::vector<std::vector<Action>> actions;  // per rank

  int num_stages() const { return num_ranks * stages_per_rank; }
  int rank_of(int stage) const { return stage % num_ranks; }
};

const char* action_name(ActionType t);
ActionType parse_action(const std::string& name);
ScheduleKind parse_kind(const std::string& name);

// The schedule of `kind` for p ranks, m micro-batches and v stages per rank (v > 1 only for
// the interleaved kinds and LoopedBFS). Throws torchpar::UsageError naming the sizes when m
// cannot be used.
Schedule make_schedule(ScheduleKind kind, int p, int m, int v = 1);

// Per-rank compute orders (F/B/W only) plus the sends and receives they imply, placed by
// add_communication(): each send right after the compute that produced it; each receive one
// compute before the compute that needs it (so it is posted while that compute runs), and
// receives from one peer in the order that peer sends.
Schedule add_communication(Schedule compute_only);

// Only the forward part (F, SEND_F, RECV_F): what eval() runs.
Schedule forward_only(const Schedule& s);

// Custom schedules: one action per line, "rank,action,microbatch,stage" (e.g. "0,F,3,0");
// '#' starts a comment, the header line "rank,action,microbatch,stage" is optional. Lines
// may hold compute actions only (communication is then added by add_communication) or a
// complete list; either way the result is checked by simulate().
Schedule schedule_from_csv(const std::string& text, int p, int m, int v);
std::string schedule_to_csv(const Schedule& s);

struct SimulationResult {
  double makespan = 0;
  std::vector<double> busy;            // per rank
  std::vector<double> bubble;          // per rank: (makespan - busy) / makespan
  std::vector<int> peak_in_flight;     // per rank: micro-batch-stages forwarded, not yet freed
  std::vector<std::vector<double>> start;  // per rank, per action: simulated start time
};

// What each compute of a stage costs: F, B (the whole backward, or B of the split) and W.
using StageCosts = std::vector<std::array<double, 3>>;

// Runs the lists with unit costs (F = 1, full B = 2, split B = 1, W = 1, messages free and
// arriving when sent), or with `costs` per stage (e.g. measured: the bubble these action lists
// leave with this model's timings and free messages, the papers' formula for unequal F, B, W).
// Throws torchpar::UsageError with the first violation: a compute before its dependency, a
// receive not posted before its use, sends and receives of a neighbour pair in different
// orders, an unmatched message, or a deadlock (no rank can move).
SimulationResult simulate(const Schedule& s, const StageCosts* costs = nullptr);

// The idle fraction the papers give for this kind with the simulator's unit costs:
// (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) for interleaved (the bubble over the
// ideal time divided by v), (p-1)/(3m+p-1) for ZB-H1 ((p-1)(tF+tB-tW) with tF=tB=tW; it holds
// for m >= p, where there are enough held-back W's to fill the cool-down), (p-1)/(3vm+p-1)
// for interleaved zero bubble; looped BFS has interleaving's when m >= p.
double theoretical_bubble(ScheduleKind kind, int p, int m, int v);

}  // namespace torchpar::pipeline
