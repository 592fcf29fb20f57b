// The one pybind11 module of the planner: dynapipe_planner._core.
#include <pybind11/pybind11.h>

#include "core.h"

PYBIND11_MODULE(_core, m) {
  m.doc() =
      "C++ hot loops of the planner (micro-batching DP, schedules, dispatch, packing, layer DP, "
      "proposal DP).";
  register_microbatch_dp(m);
  register_schedule(m);
  register_dispatch(m);
  register_packing(m);
  register_layer_dp(m);
  register_first_fit(m);
  register_proposal_dp(m);
}
