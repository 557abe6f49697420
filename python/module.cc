// The module limbo._core: the bindings of Core (python/core.h).
#include "core.h"

#include <csignal>

PYBIND11_MODULE(_core, m) {
  using limbo::python::Core;
  m.doc() = "Limbo's elastic step for a training loop in Python (use the `limbo` package)";
  static py::exception<limbo::InvalidInput> invalid(m, "InvalidInput", PyExc_ValueError);
  static py::exception<limbo::Error> error(m, "LimboError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const limbo::InvalidInput& e) {
      invalid(e.what());
    } catch (const limbo::train::Interrupted& e) {
      // Asked to stop (Ctrl-C, SIGTERM, Slurm's warning) while waiting for a
      // group: as Python would end on the signal.
      const int sig = limbo::elastic::leave_signal();
      if (sig == SIGINT) {
        PyErr_SetString(PyExc_KeyboardInterrupt, e.what());
      } else {
        py::object code = py::int_(limbo::elastic::exit_code_for(sig));
        PyErr_SetObject(PyExc_SystemExit, code.ptr());
      }
    } catch (const limbo::Error& e) {
      error(e.what());
    }
  });
  py::class_<Core>(m, "Core")
      .def(py::init<const limbo::python::Named&, const limbo::python::Named&, const py::dict&, py::function,
                    py::function, py::function>())
      .def("start", &Core::start)
      .def("complete", &Core::complete)
      .def("plan", &Core::plan)
      .def("clear_plans", &Core::clear_plans)
      .def("outer_finish", &Core::outer_finish)
      .def("committed_ids", &Core::committed_ids)
      .def_property_readonly("diloco", &Core::diloco)
      .def("begin_step", &Core::begin_step)
      .def("units", &Core::units)
      .def("gather_unit", &Core::gather_unit, py::arg("u"), py::arg("forward") = true)
      .def("release_unit", &Core::release_unit)
      .def("backward_starts", &Core::backward_starts)
      .def("no_sync", &Core::no_sync)
      .def("step", &Core::step)
      .def("after_step", &Core::after_step)
      .def("checkpoint", &Core::checkpoint)
      .def("log", &Core::log)
      .def("record", &Core::record)
      .def("end_training", &Core::end_training)
      .def("finish", &Core::finish)
      .def("global_ids", &Core::global_ids)
      .def("batch_ids", &Core::batch_ids)
      .def("optimizer_state", &Core::optimizer_state)
      .def("gather_weights", &Core::gather_weights)
      .def("eval_share", &Core::eval_share)
      .def("eval_reduce", &Core::eval_reduce)
      .def_property_readonly("world", &Core::world)
      .def_property_readonly("rank", &Core::rank)
      .def_property_readonly("generation", &Core::generation)
      .def_property_readonly("steps", &Core::steps)
      .def_property_readonly("samples", &Core::samples)
      .def_property_readonly("cursor", &Core::cursor)
      .def_property_readonly("epoch", &Core::epoch)
      .def_property_readonly("lr_multiplier", &Core::lr_multiplier)
      .def_property_readonly("global_batch", &Core::global_batch)
      .def_property_readonly("writer", &Core::writer)
      .def_property_readonly("left", &Core::left)
      .def_property_readonly("elastic", &Core::elastic)
      .def_property_readonly("in_step", &Core::in_step)
      .def_property_readonly("last_loss", &Core::last_loss)
      .def_property_readonly("run_dir", &Core::run_dir);
}

