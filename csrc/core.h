// Registration hooks: each C++ source file binds its own functions into the module.
#pragma once

#include <pybind11/pybind11.h>

void register_microbatch_dp(pybind11::module_& m);
