# cmake -DIN=file -DOUT=file.cc -DNS=namespace -DFN=function -P embed.cmake
# Writes a C++ file defining `const std::string& NS::FN()` holding IN's bytes.
file(READ "${IN}" hex HEX)
string(LENGTH "${hex}" n)
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${hex}")
string(REGEX REPLACE "(0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,)" "\\1\n" bytes "${bytes}")
file(WRITE "${OUT}" "// Generated from ${IN} by cmake/embed.cmake; do not edit.\n#include <string>\nnamespace ${NS} {\nnamespace {\nconst unsigned char kBytes[] = {\n${bytes}0};\n}  // namespace\nconst std::string& ${FN}() {\n  static const std::string s(reinterpret_cast<const char*>(kBytes), sizeof kBytes - 1);\n  return s;\n}\n}  // namespace ${NS}\n")
