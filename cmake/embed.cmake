# SPDX-License-Identifier: Apache-2.0
# Writes a text file as a NUL-terminated C array, so a template (tools/report.html) is edited as
# the file it is and still built into the binary.
# usage: cmake -DIN=FILE -DOUT=FILE.c -DNAME=SYMBOL -P cmake/embed.cmake
file(READ "${IN}" hex HEX)
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," body "${hex}")
string(REGEX REPLACE "((0x..,){24})" "\\1\n" body "${body}")
get_filename_component(name "${IN}" NAME)
file(WRITE "${OUT}" "/* Generated from ${name} by cmake/embed.cmake: edit that file instead. */\n"
  "const char ${NAME}[] = {\n${body}0};\n")
