// An aten op's schema as the kinds of wire value each argument takes, for the op path in fast_op.cpp.
//
// Why a kind per argument, fixed when the op is defined: the wire carries msgpack values and the schema
// says what each must become; looked up once per op (Msg.DEFINE), not once per message.
#pragma once

#include "fast_substitutes.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>

#include <optional>
#include <vector>

namespace rgpu_server {

namespace py = pybind11;

enum class Kind : uint8_t {
  Tensor, TensorList, OptTensorList, Int, IntList, Float, Bool, BoolList, Scalar, ScalarList, ScalarType, Layout,
  MemoryFormat, Device, Str, Generator
};

struct Arg {
  Kind kind;
  bool optional, kwarg_only;
  py::object name;                   // interned, for the kwargs dict
  std::optional<c10::IValue> dflt;   // the schema's default, when it has one
};

struct Op {
  c10::OperatorHandle handle;
  Recipe recipe = nullptr;           // a substitute's (fast_substitutes.h), run instead of the op's kernel
  bool wraps_numbers = false;        // a number for a Tensor argument: a wrapped number, as torch.ops makes it
  std::vector<Arg> args;
  std::vector<size_t> checked;       // positions of written arguments whose layout is checked afterwards
  explicit Op(c10::OperatorHandle h) : handle(std::move(h)) {}
};

// Why a one-kind-per-type table: the wire carries msgpack values; the schema says what each must become.
inline bool kind_of(const c10::Argument& a, bool on_cuda, Arg& out) {
  c10::TypePtr t = a.real_type();
  out.optional = false;
  if (auto o = t->castRaw<c10::OptionalType>()) {
    out.optional = true;
    t = o->getElementType();
  }
  switch (t->kind()) {
    case c10::TypeKind::TensorType: out.kind = Kind::Tensor; return true;
    case c10::TypeKind::IntType: case c10::TypeKind::SymIntType: out.kind = Kind::Int; return true;
    case c10::TypeKind::FloatType: case c10::TypeKind::SymFloatType: out.kind = Kind::Float; return true;
    case c10::TypeKind::BoolType: case c10::TypeKind::SymBoolType: out.kind = Kind::Bool; return true;
    case c10::TypeKind::NumberType: out.kind = Kind::Scalar; return true;
    case c10::TypeKind::StringType: out.kind = Kind::Str; return true;
    case c10::TypeKind::ScalarTypeType: out.kind = Kind::ScalarType; return true;
    case c10::TypeKind::LayoutType: out.kind = Kind::Layout; return true;
    case c10::TypeKind::MemoryFormatType: out.kind = Kind::MemoryFormat; return true;
    case c10::TypeKind::DeviceObjType: out.kind = Kind::Device; return true;
    case c10::TypeKind::GeneratorType: out.kind = Kind::Generator; return on_cuda;  // the CPU picks its own
    case c10::TypeKind::ListType: {
      c10::TypePtr e = t->castRaw<c10::ListType>()->getElementType();
      if (out.optional && e->kind() != c10::TypeKind::IntType && e->kind() != c10::TypeKind::SymIntType) return false;
      switch (e->kind()) {
        case c10::TypeKind::TensorType: out.kind = Kind::TensorList; return true;
        case c10::TypeKind::IntType: case c10::TypeKind::SymIntType: out.kind = Kind::IntList; return true;
        case c10::TypeKind::BoolType: out.kind = Kind::BoolList; return true;
        case c10::TypeKind::NumberType: out.kind = Kind::ScalarList; return true;
        case c10::TypeKind::OptionalType:
          if (e->castRaw<c10::OptionalType>()->getElementType()->kind() != c10::TypeKind::TensorType) return false;
          out.kind = Kind::OptTensorList;
          return true;
        default: return false;
      }
    }
    default: return false;
  }
}

}  // namespace rgpu_server
