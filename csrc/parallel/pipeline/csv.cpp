// Custom schedules as CSV: "rank,action,microbatch,stage", one action per line.
#include <sstream>

#include "common/error.h"
#include "parallel/pipeline/schedule.h"

namespace torchpar::pipeline {

namespace {

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r"), e = s.find_last_not_of(" \t\r");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

int parse_int(const std::string& field, int line, const char* what) {
  try {
    size_t used = 0;
    int v = std::stoi(field, &used);
    if (used == field.size()) return v;
  } catch (const std::exception&) {
  }
  TP_CHECK_USAGE(false, "schedule CSV line ", line, ": ", what, " '", field, "' is not an integer");
  return 0;
}

}  // namespace

Schedule schedule_from_csv(const std::string& text, int p, int m, int v) {
  TP_CHECK_USAGE(p >= 1 && m >= 1 && v >= 1, "schedule CSV: p, m and v must be >= 1 (got ", p, ", ", m, ", ", v, ")");
  // Neighbouring stages on one rank would hand off to that rank itself, which no process group does.
  TP_CHECK_USAGE(p >= 2 || v == 1, "schedule CSV: ", v, " stages on 1 pipeline rank (stages hand off between ranks)");
  Schedule s;
  s.kind = ScheduleKind::Custom;
  s.num_ranks = p;
  s.num_microbatches = m;
  s.stages_per_rank = v;
  s.actions.resize(p);
  std::istringstream in(text);
  std::string raw;
  bool has_comm = false;
  for (int line = 1; std::getline(in, raw); ++line) {
    std::string row = trim(raw.substr(0, raw.find('#')));
    if (row.empty() || row.rfind("rank", 0) == 0) continue;  // blank, comment or header
    std::vector<std::string> f;
    std::stringstream cells(row);
    for (std::string c; std::getline(cells, c, ',');) f.push_back(trim(c));
    TP_CHECK_USAGE(f.size() == 4, "schedule CSV line ", line, ": expected rank,action,microbatch,stage; got '", row, "'");
    int rank = parse_int(f[0], line, "rank");
    TP_CHECK_USAGE(rank >= 0 && rank < p, "schedule CSV line ", line, ": rank ", rank, " out of range for ", p, " ranks");
    Action a{parse_action(f[1]), parse_int(f[2], line, "microbatch"), parse_int(f[3], line, "stage")};
    // Checked here, with the line, before add_communication does rank arithmetic on the stage
    // (a negative stage gave a negative rank index there: an out-of-bounds write).
    TP_CHECK_USAGE(a.microbatch >= 0 && a.microbatch < m, "schedule CSV line ", line, ": micro-batch ",
                   a.microbatch, " out of range for ", m, " micro-batches");
    TP_CHECK_USAGE(a.stage >= 0 && a.stage < s.num_stages(), "schedule CSV line ", line, ": stage ", a.stage,
                   " out of range for ", s.num_stages(), " stages");
    TP_CHECK_USAGE(s.rank_of(a.stage) == rank, "schedule CSV line ", line, ": stage ", a.stage, " lives on rank ",
                   s.rank_of(a.stage), ", not on rank ", rank);
    if (a.type == ActionType::W) s.split_backward = true;
    if (a.type != ActionType::F && a.type != ActionType::B && a.type != ActionType::W) has_comm = true;
    s.actions[rank].push_back(a);
  }
  if (!has_comm) s = add_communication(std::move(s));
  simulate(s);  // throws on any order, matching or deadlock problem
  return s;
}

std::string schedule_to_csv(const Schedule& s) {
  std::ostringstream out;
  out << "rank,action,microbatch,stage\n";
  for (int r = 0; r < s.num_ranks; ++r) {
    for (const Action& a : s.actions[r]) out << r << ',' << action_name(a.type) << ',' << a.microbatch << ',' << a.stage << '\n';
  }
  return out.str();
}

}  // namespace torchpar::pipeline
