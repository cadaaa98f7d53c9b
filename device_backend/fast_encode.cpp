// fast_encode.cpp: a boxed call as encode.py would see it: its signature, its msgpack, its Python objects.
//
// The signature keeps what output metadata may depend on (tensor geometry and
// dtypes, scalar types, scalar values unless encode.py keys them by type), and
// refuses what only Python handles (CPU tensors other than wrapped numbers, math
// bits, generators, devices, layouts). The wire form is what the Python fallback
// would send for the same call: positional arguments up to the last that is not
// its default, keyword-only ones unless at their default, values tagged as in
// rgpu.protocol.ops.TAG (RGPU_TAG_* in rgpu_protocol.h).
#include "fast_path.h"
#include "rgpu_device.h"

#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/tensor_memoryformats.h>

namespace rgpu {
namespace {

bool is_kind(const c10::Argument& a, c10::TypeKind kind) {
  const auto& t = a.real_type();
  if (t->kind() == kind) return true;
  auto opt = t->cast<c10::OptionalType>();
  return opt && opt->getElementType()->kind() == kind;
}

}  // namespace

Arguments arguments_of(const c10::FunctionSchema& schema) {
  Arguments r;
  const auto& args = schema.arguments();
  bool writes = false, outs = false;
  for (const auto& a : args) {
    bool w = a.alias_info() && a.alias_info()->isWrite();
    writes |= w;
    outs |= w && a.kwarg_only();
    r.kinds.push_back(is_kind(a, c10::TypeKind::ScalarTypeType) ? Kind::kDtype
                      : (is_kind(a, c10::TypeKind::LayoutType) || is_kind(a, c10::TypeKind::MemoryFormatType) ||
                         is_kind(a, c10::TypeKind::DeviceObjType) || is_kind(a, c10::TypeKind::GeneratorType))
                          ? Kind::kNoneOnly
                          : Kind::kPlain);
  }
  r.by_type = writes && !outs;
  r.kwarg_only_start = args.size();
  while (r.kwarg_only_start > 0 && args[r.kwarg_only_start - 1].kwarg_only()) --r.kwarg_only_start;
  return r;
}

namespace {

// ---- the signature: what output metadata may depend on, as encode.py's key ----

template <typename T>
void put(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

bool device_tensor(const at::Tensor& t) {
  return t.defined() && t.device().type() == c10::DeviceType::PrivateUse1 && !t.is_conj() && !t.is_neg() &&
         t.layout() == at::kStrided && !t.key_set().has(c10::DispatchKey::Python);
}

bool wrapped_number(const at::Tensor& t) {
  return t.defined() && t.unsafeGetTensorImpl()->is_wrapped_number() && t.device().is_cpu() &&
         (t.scalar_type() == at::kDouble || t.scalar_type() == at::kLong || t.scalar_type() == at::kBool);
}

bool sig_double(std::string& s, double v, bool by_type) {
  s.push_back('f');
  if (!by_type) put(s, v);
  return true;
}

bool sig_value(std::string& s, const c10::IValue& v, bool by_type, int& device) {
  if (v.isNone() || (v.isTensor() && !v.toTensor().defined())) {  // Python sees None for both
    s.push_back('N');
  } else if (v.isTensor()) {
    const auto& t = v.toTensor();
    if (wrapped_number(t)) {  // Python sees the number (torch::jit::toPyObject)
      if (t.scalar_type() == at::kDouble) return sig_double(s, *t.const_data_ptr<double>(), by_type);
      s.push_back(t.scalar_type() == at::kLong ? 'i' : 'b');
      put(s, t.scalar_type() == at::kLong ? *t.const_data_ptr<int64_t>()
                                          : static_cast<int64_t>(*t.const_data_ptr<bool>()));
      return true;
    }
    if (!device_tensor(t)) return false;
    int d = t.device().index();
    if (device < 0) device = d;
    if (d != device) return false;  // Python raises (or mixes, for copies): its business
    s.push_back('T');
    put(s, static_cast<int8_t>(t.scalar_type()));
    put(s, static_cast<int8_t>(d));
    put(s, static_cast<int32_t>(t.dim()));
    for (auto x : t.sizes()) put(s, x);
    for (auto x : t.strides()) put(s, x);
    put(s, t.storage_offset());
    put(s, t.storage().nbytes());
  } else if (v.isDouble()) {
    return sig_double(s, v.toDouble(), by_type);
  } else if (v.isInt()) {
    s.push_back('i');
    put(s, v.toInt());
  } else if (v.isBool()) {
    s.push_back('b');
    put(s, static_cast<int64_t>(v.toBool()));
  } else if (v.isString()) {
    const auto& str = v.toStringRef();
    s.push_back('s');
    put(s, str.size());
    s.append(str);
  } else if (v.isList()) {
    auto items = v.toListRef();
    s.push_back('L');
    put(s, items.size());
    for (const auto& x : items)
      if (!sig_value(s, x, by_type, device)) return false;
  } else {
    return false;
  }
  return true;
}

}  // namespace

bool signature(std::string& sig, const Arguments& a, c10::ArrayRef<c10::IValue> args, int& device) {
  for (size_t i = 0; i < args.size(); ++i) {
    bool ok = a.kinds[i] == Kind::kNoneOnly ? args[i].isNone() : sig_value(sig, args[i], a.by_type, device);
    if (!ok) return false;
  }
  return true;
}

namespace {

// ---- the wire: msgpack of what encode.py makes of the same values ----

void pack_ints(Packer& p, at::IntArrayRef values) {
  p.array(values.size());
  for (auto x : values) p.integer(x);
}

}  // namespace

void pack_descriptor(Packer& p, const at::TensorBase& t) {
  const auto& storage = t.storage();
  p.array(7);
  p.integer(static_cast<int64_t>(id_of(storage.data())));
  p.integer(static_cast<int64_t>(storage.nbytes()));
  p.integer(static_cast<int64_t>(t.scalar_type()));
  pack_ints(p, t.sizes());
  pack_ints(p, t.strides());
  p.integer(t.storage_offset());
  p.integer(t.device().index());
}

namespace {

void pack_value(Packer& p, const c10::IValue& v, Kind kind) {  // sig_value() accepted v
  if (v.isNone() || (v.isTensor() && !v.toTensor().defined())) {
    p.nil();
  } else if (kind == Kind::kDtype) {
    p.map(1);
    p.str(RGPU_TAG_DTYPE);
    p.integer(v.toInt());
  } else if (v.isTensor()) {
    const auto& t = v.toTensor();
    if (!wrapped_number(t)) {
      p.map(1);
      p.str(RGPU_TAG_TENSOR);
      pack_descriptor(p, t);
    } else if (t.scalar_type() == at::kDouble) {
      p.real(*t.const_data_ptr<double>());
    } else if (t.scalar_type() == at::kLong) {
      p.integer(*t.const_data_ptr<int64_t>());
    } else {
      p.boolean(*t.const_data_ptr<bool>());
    }
  } else if (v.isDouble()) {
    p.real(v.toDouble());
  } else if (v.isInt()) {
    p.integer(v.toInt());
  } else if (v.isBool()) {
    p.boolean(v.toBool());
  } else if (v.isString()) {
    p.str(v.toStringRef());
  } else {
    auto items = v.toListRef();
    p.array(items.size());
    for (const auto& x : items) pack_value(p, x, Kind::kPlain);
  }
}

// Arguments as PyTorch's Python fallback receives them: positional arguments up to
// the last one that is not its default, keyword-only ones unless at their default
// (torch/csrc/autograd/python_variable.cpp, parseIValuesToPyArgsKwargs).
bool is_default(const c10::Argument& a, const c10::IValue& v) {
  return a.default_value().has_value() && !(*a.default_value() != v);
}

size_t positional_end(const c10::FunctionSchema& schema, const Arguments& r, c10::ArrayRef<c10::IValue> args) {
  size_t end = r.kwarg_only_start;
  while (end > 0 && is_default(schema.arguments()[end - 1], args[end - 1])) --end;
  return end;
}

}  // namespace

void pack_arguments(Packer& p, const c10::FunctionSchema& schema, const Arguments& r,
                    c10::ArrayRef<c10::IValue> args) {
  size_t end = positional_end(schema, r, args);
  p.array(end);
  for (size_t i = 0; i < end; ++i) pack_value(p, args[i], r.kinds[i]);
  size_t count = 0;
  for (size_t i = r.kwarg_only_start; i < args.size(); ++i) count += !is_default(schema.arguments()[i], args[i]);
  p.map(count);
  for (size_t i = r.kwarg_only_start; i < args.size(); ++i) {
    if (is_default(schema.arguments()[i], args[i])) continue;
    p.str(schema.arguments()[i].name());
    pack_value(p, args[i], r.kinds[i]);
  }
}

// ---- a miss: the call for the Python fallback, with PyTorch's own conversions ----

std::pair<py::tuple, py::dict> to_python(const c10::FunctionSchema& schema, const Arguments& r,
                                         c10::ArrayRef<c10::IValue> args) {
  auto value = [&](size_t i) -> py::object {
    const auto& a = schema.arguments()[i];
    const auto& v = args[i];
    if (v.isNone()) return py::none();
    if (is_kind(a, c10::TypeKind::ScalarTypeType))
      return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(v.toScalarType())));
    if (is_kind(a, c10::TypeKind::LayoutType))
      return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPLayout(v.toLayout())));
    if (is_kind(a, c10::TypeKind::MemoryFormatType))
      return py::reinterpret_borrow<py::object>(torch::utils::getTHPMemoryFormat(v.toMemoryFormat()));
    return torch::jit::toPyObject(v);
  };
  size_t end = positional_end(schema, r, args);
  py::tuple positional(end);
  for (size_t i = 0; i < end; ++i) positional[i] = value(i);
  py::dict kwargs;
  for (size_t i = r.kwarg_only_start; i < args.size(); ++i)
    if (!is_default(schema.arguments()[i], args[i])) kwargs[py::str(schema.arguments()[i].name())] = value(i);
  return {std::move(positional), std::move(kwargs)};
}

void push_result(const c10::FunctionSchema& schema, torch::jit::Stack* stack, py::handle out) {
  const auto& rets = schema.returns();
  if (rets.empty()) {
    TORCH_CHECK(out.is_none(), "rgpu: ", schema.name(), " returns nothing, the fallback returned a value");
  } else if (rets.size() == 1) {
    stack->push_back(torch::jit::toIValue(out, rets[0].real_type()));
  } else {
    auto seq = py::reinterpret_borrow<py::sequence>(out);
    for (size_t i = 0; i < rets.size(); ++i) stack->push_back(torch::jit::toIValue(seq[i], rets[i].real_type()));
  }
}


}  // namespace rgpu
